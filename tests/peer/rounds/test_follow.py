"""Following a shard (hlbp.peer.rounds.follow): a stage-1 peer that follows shard 0 applies a round's accepted set
to its copy bit for bit as a full replica holding shard 0 does, and a hostile or missing followed payload never
crashes it.

The runners are the real ``RoundRunner`` with real models, outer optimizers and wire bytes; only the data plane is
:class:`Blobs`, an in-process implementation of the ``BlobTransport`` interface (each peer's served blobs in a
dict), so the round's apply runs without processes. The real data plane is exercised by
``tests/peer/node/test_heterogeneous_run.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

from hlbp.peer.model.decoder import ModelConfig, load_from_full, split
from hlbp.peer.model.pipeline import initial_model, initial_state
from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds.contribution import contribution_to_bytes
from hlbp.peer.rounds.follow import follow_anchor, resync_plan
from hlbp.peer.rounds.outcome import Applied, Refused
from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo
from hlbp.peer.rounds.sparseloco import RoundConfig, RoundRunner
from hlbp.peer.rounds.statesync import encode_state, shard_checksum, state_name
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import Identity, sha256_hex
from hlbp.protocol.roundwire import AcceptedSet, ShardChecks

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, d_ff=64, max_seq_len=16)
BOUNDS = [(0, 2), (2, 4)]
OUTER = OuterConfig(k=64, aggregation="selectors", clip_median=True)
RUN = "follow-test"
ROUND = 0
SEED = 5
CPU = torch.device("cpu")


class Blobs:
    """In-process ``BlobTransport``: ``registry`` maps a peer id to the blobs it serves."""

    def __init__(self, registry: dict[str, dict[str, bytes]], peer_id: str) -> None:
        self.registry, self.peer_id, self.bytes_served = registry, peer_id, 0
        registry.setdefault(peer_id, {})

    def put(self, name: str, data: bytes) -> None:
        self.registry[self.peer_id][name] = data

    def put_lazy(self, name: str, make: Callable[[], bytes | None]) -> None:
        data = make()  # made at once: these runners are in-process, and the tensors it reads are alive now
        if data is not None:
            self.put(name, data)

    def get(self, name: str) -> bytes | None:
        return self.registry[self.peer_id].get(name)

    def drop(self, names: Iterable[str]) -> None:
        for name in names:
            self.registry[self.peer_id].pop(name, None)

    def drop_prefix(self, prefix: str) -> None:
        self.drop([n for n in self.registry[self.peer_id] if n.startswith(prefix)])

    @contextlib.contextmanager
    def sharing(self, name: str) -> Iterator[None]:
        """Nothing to wait for: an in-process fetch is complete when it returns."""
        yield

    def push(self, peer_ids: Iterable[str], key: str, body: bytes) -> None:
        """These runners read no round records: the tests hand them their accepted sets."""

    def set_push_handler(self, handler: object) -> None:
        """Nothing is pushed here (see :meth:`push`)."""

    def fetch(self, peer_id: str, name: str, max_size: int, timeout: float) -> bytes:
        data = self.registry.get(peer_id, {}).get(name)
        if data is None:
            raise TransportError(f"{peer_id[:8]} does not serve {name}")
        if len(data) > max_size:
            raise ProtocolError(f"body of {len(data)} bytes above the limit {max_size}")
        return data

    def close(self) -> None:
        pass


def _names_and_shapes() -> tuple[list[list[str]], list[dict[str, tuple[int, ...]]]]:
    with torch.device("meta"):
        stages = split(CONFIG, len(BOUNDS), BOUNDS)
    return ([[n for n, _ in s.named_parameters()] for s in stages],
            [{n: tuple(p.shape) for n, p in s.named_parameters()} for s in stages])


SHARDS, SHAPES = _names_and_shapes()


def _no_batches(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError("these runners never train")


def _runner(ident: Identity, registry: dict, held: list[int] | None, cls: type[RoundRunner] = RoundRunner) -> Any:
    """A full replica (``held`` None) or a stage-1 peer that follows shard 0 (``held`` [1])."""
    full = initial_state(CONFIG, SEED)
    if held is None:
        model: torch.nn.Module = initial_model(CONFIG, SEED)
        follow = None
    else:
        model = split(CONFIG, len(BOUNDS), BOUNDS)[1]
        load_from_full(model, full)
        follow = {0: {n: full[n] for n in SHARDS[0]}}
    trainer = InnerTrainer(model, OptimConfig(), _no_batches, CPU)
    cfg = RoundConfig(run_id=RUN, inner_steps=1, fetch_timeout_s=1.0)
    runner = cls(None, ident, Blobs(registry, ident.peer_id), trainer, OUTER, SHARDS, cfg, threading.Event(),
                 held=held, shapes=SHAPES, follow=follow)
    runner.payloads.measure_scales(runner.state.anchor, runner.shards)
    return runner


def _contribution(sender: str, shard: int, scale: float, seed: int) -> bytes:
    """A real SparseLoCo payload of ``sender`` for ``shard``: its pseudo-gradient after random inner progress."""
    anchor = {n: t for n, t in initial_state(CONFIG, SEED).items() if n in SHARDS[shard]}
    g = torch.Generator().manual_seed(seed)
    local = {n: t + scale * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
    c = SparseLoCo(OUTER).contribute(anchor, local, sender, tokens=256)
    return contribution_to_bytes(c, OUTER, RUN, ROUND, shard)


@pytest.fixture()
def round_setup() -> dict:
    """Two full replicas (h: the reference holder, b), a stage-0 peer (s0) and the stage-1 follower (f); each
    serves its own payloads. Contributions differ in size, so median-norm clipping weighs them differently."""
    ids = {name: Identity.generate() for name in ("h", "b", "s0", "f")}
    registry: dict[str, dict[str, bytes]] = {}
    plan = {"h": {0: 0.01, 1: 0.01}, "b": {0: 0.05, 1: 0.002}, "s0": {0: 0.02}, "f": {1: 0.03}}
    members = []
    for i, (name, shards) in enumerate(plan.items()):
        pid = ids[name].peer_id
        digests = {}
        for s, scale in shards.items():
            blob = _contribution(pid, s, scale, seed=10 * i + s)
            registry.setdefault(pid, {})[f"c/{ROUND}/{s}/{pid}"] = blob
            digests[s] = sha256_hex(blob)
        members.append((pid, 256, digests))
    accepted = AcceptedSet(ids["h"].peer_id, ROUND, tuple(sorted(members)))
    return {"ids": ids, "registry": registry, "accepted": accepted}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in names)


def test_follower_applies_the_followed_shard_bit_for_bit_as_a_holder(round_setup: dict) -> None:
    ids, registry, accepted = round_setup["ids"], round_setup["registry"], round_setup["accepted"]
    holder = _runner(ids["h"], registry, None)
    follower = _runner(ids["f"], registry, [1])
    before = {n: follower.state.anchor[n].clone() for n in SHARDS[0]}
    assert holder.apply_round(ROUND, accepted) == Applied()
    assert follower.apply_round(ROUND, accepted) == Applied()
    for shard in (0, 1):
        assert _same(holder.state.anchor, follower.state.anchor, SHARDS[shard]), f"shard {shard} differs"
        assert shard_checksum(holder.state.anchor, SHARDS[shard]) == shard_checksum(follower.state.anchor, SHARDS[shard])
    assert not _same(before, follower.state.anchor, SHARDS[0])  # the round moved the followed shard
    # it follows, it does not hold: its checks name shard 1 alone, so it never vouches for shard 0
    assert set(follower.syncer.checks(follower.state, ROUND).checksums) == {1}
    # and it loads only its own stage into its model
    assert set(dict(follower.trainer.model.named_parameters())) == set(SHARDS[1])


def test_a_followed_payload_that_does_not_decode_refuses_the_round_as_on_a_holder(round_setup: dict) -> None:
    ids, registry, accepted = round_setup["ids"], round_setup["registry"], round_setup["accepted"]
    s0 = ids["s0"].peer_id
    garbage = b"\x00" * 200
    registry[s0][f"c/{ROUND}/0/{s0}"] = garbage
    hostile = AcceptedSet(accepted.coordinator, ROUND, tuple(
        (p, t, {0: sha256_hex(garbage)} if p == s0 else d) for p, t, d in accepted.members))
    holder, follower = _runner(ids["h"], registry, None), _runner(ids["f"], registry, [1])
    initial = {n: follower.state.anchor[n].clone() for n in follower.state.anchor}
    for runner in (holder, follower):
        outcome = runner.apply_round(ROUND, hostile)
        assert isinstance(outcome, Refused) and outcome.why == "an accepted contribution does not decode", outcome
        assert set(outcome.offenders) == {s0}
        assert set(runner.closer.bans) == {s0}
    assert _same(initial, follower.state.anchor, list(initial))  # nothing moved, neither its shard nor the followed one


def test_a_followed_payload_under_another_senders_name_is_refused(round_setup: dict) -> None:
    ids, registry, accepted = round_setup["ids"], round_setup["registry"], round_setup["accepted"]
    s0, b = ids["s0"].peer_id, ids["b"].peer_id
    copied = registry[b][f"c/{ROUND}/0/{b}"]  # b's own payload, served as s0's
    registry[s0][f"c/{ROUND}/0/{s0}"] = copied
    hostile = AcceptedSet(accepted.coordinator, ROUND, tuple(
        (p, t, {0: sha256_hex(copied)} if p == s0 else d) for p, t, d in accepted.members))
    follower = _runner(ids["f"], registry, [1])
    assert isinstance(follower.apply_round(ROUND, hostile), Refused), "a payload claiming another sender was applied"
    assert s0 in follower.closer.bans


def test_a_missing_followed_payload_leaves_only_the_followed_shard_behind(round_setup: dict) -> None:
    ids, registry, accepted = round_setup["ids"], round_setup["registry"], round_setup["accepted"]
    reference = _runner(ids["h"], registry, None)
    assert reference.apply_round(ROUND, accepted) == Applied()
    s0 = ids["s0"].peer_id
    for served in registry.values():  # nobody can serve s0's shard-0 payload any more (the reference holder
        served.pop(f"c/{ROUND}/0/{s0}", None)  # fetched it and serves it onwards: gossip)
    follower = _runner(ids["f"], registry, [1])
    initial = {n: follower.state.anchor[n].clone() for n in SHARDS[0]}
    assert follower.apply_round(ROUND, accepted) == Applied()  # its own shard is not held hostage by a followed one
    assert _same(reference.state.anchor, follower.state.anchor, SHARDS[1])
    assert _same(initial, follower.state.anchor, SHARDS[0])
    # ... and the check after the round sees the followed copy off the holders' majority and names who has it
    ours = {0: shard_checksum(follower.state.anchor, SHARDS[0])}
    holders = [ShardChecks(ids["h"].peer_id, ROUND, {0: shard_checksum(reference.state.anchor, SHARDS[0]), 1: "x"}),
               ShardChecks(ids["s0"].peer_id, ROUND, {0: shard_checksum(reference.state.anchor, SHARDS[0])})]
    assert resync_plan(holders, ROUND, ours) == {
        0: (shard_checksum(reference.state.anchor, SHARDS[0]), sorted([ids["h"].peer_id, ids["s0"].peer_id]))}


def test_resync_plan_fetches_only_a_copy_that_differs_from_its_holders() -> None:
    checks = [ShardChecks("a", 3, {0: "good", 1: "one"}), ShardChecks("b", 3, {0: "good"}),
              ShardChecks("c", 3, {0: "bad"}), ShardChecks("d", 2, {0: "old"})]
    assert resync_plan(checks, 3, {0: "good"}) == {}
    assert resync_plan(checks, 3, {0: "mine"}) == {0: ("good", ["a", "b"])}
    assert resync_plan(checks, 4, {0: "mine"}) == {}  # nobody published round 4 yet: keep our own
    assert resync_plan(checks, 3, {2: "mine"}) == {}  # no holder of shard 2 spoke


def test_follow_anchor_checks_what_it_is_given() -> None:
    full = initial_state(CONFIG, SEED)
    shard0 = {n: full[n] for n in SHARDS[0]}
    got = follow_anchor(SHARDS, SHAPES, [1], {0: shard0})
    assert set(got) == set(SHARDS[0]) and all(torch.equal(got[n], full[n]) for n in got)
    with pytest.raises(ValueError, match="cannot be followed"):
        follow_anchor(SHARDS, SHAPES, [0], {0: shard0})  # a held shard is not followed
    with pytest.raises(ValueError, match="cannot be followed"):
        follow_anchor(SHARDS, SHAPES, [1], {5: shard0})
    with pytest.raises(ValueError, match="does not hold exactly its parameters"):
        follow_anchor(SHARDS, SHAPES, [1], {0: {n: full[n] for n in SHARDS[0][1:]}})
    bad = dict(shard0, **{"embed.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="has shape"):
        follow_anchor(SHARDS, SHAPES, [1], {0: bad})


def test_a_copy_off_its_holders_is_fetched_from_them_and_verified(round_setup: dict) -> None:
    ids, registry, accepted = round_setup["ids"], round_setup["registry"], round_setup["accepted"]
    holder = _runner(ids["h"], registry, None)
    assert holder.apply_round(ROUND, accepted) == Applied()
    want = shard_checksum(holder.state.anchor, SHARDS[0])
    # the holder serves its shard-0 state; a lying donor serves another state under the same name
    registry[ids["h"].peer_id][state_name(ROUND, 0)] = encode_state(holder.state.anchor, SHARDS[0], {})
    liar = dict(holder.state.anchor, **{"embed.weight": holder.state.anchor["embed.weight"] + 1.0})
    registry[ids["s0"].peer_id][state_name(ROUND, 0)] = encode_state(liar, SHARDS[0], {})
    follower = _runner(ids["f"], registry, [1])  # never applied the round: its copy is the seed's
    # the holders' published checksums, given instead of read from the DHT; s0 claims the majority's checksum
    published = [ShardChecks(ids["h"].peer_id, ROUND, {0: want, 1: "x"}), ShardChecks(ids["s0"].peer_id, ROUND, {0: want})]
    follower.records.latest_checks = lambda: list(published)
    follower.check_followed(ROUND)
    assert follower.follower.fetches == 1
    assert _same(holder.state.anchor, follower.state.anchor, SHARDS[0])  # the liar's blob failed the checksum: not taken
    follower.check_followed(ROUND)  # now equal: nothing more to fetch
    assert follower.follower.fetches == 1
    # when no donor serves the agreed state (the liar's fails the checksum, b serves none) the copy stays as it
    # is, and nothing raises
    stale = _runner(ids["f"], registry, [1])
    agreed = [ShardChecks(ids["s0"].peer_id, ROUND, {0: want}), ShardChecks(ids["b"].peer_id, ROUND, {0: want})]
    stale.records.latest_checks = lambda: list(agreed)
    stale.check_followed(ROUND)
    assert stale.follower.fetches == 0 and shard_checksum(stale.state.anchor, SHARDS[0]) != want
