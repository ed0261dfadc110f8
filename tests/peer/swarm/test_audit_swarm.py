"""Audits of a lying middle stage, on real hivemind P2P daemons on loopback: a driver (stage 0), a middle stage and
a last stage, every hop signed and kept (``Notary``), each peer serving its transcript on a real blob transport,
and an auditor that holds the run's initial weights (the anchor of round 0) and fetches the evidence over the
network.

The liar is a real :class:`StageServer` whose :class:`StageWorker` is wrapped from here: it scales, flips or
replaces with noise the activations it sends on, or the gradients it sends back, on every micro-batch or on one
in ten. What must hold: every honest sample is clean (and the errors of honest frames are printed, step by step,
as the tolerance's evidence); a liar's sampled lie is found guilty by the finding that fits it; a peer cannot deny
a frame (what the auditor checks is what the neighbours hold, signed by the liar).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from lying_stage_peer import LyingWorker

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.model.subspace import make_codec
from hlbp.peer.net.transport import P2PBlobTransport
from hlbp.peer.swarm.audit import Finding
from hlbp.peer.swarm.auditor import AuditConfig, Auditor
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer, max_body_bytes
from hlbp.peer.swarm.transcript import Notary
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.trainer import OptimConfig, lr_at, skeleton
from hlbp.peer.train.turns import Turns
from hlbp.protocol.identity import Identity
from hlbp.protocol.transcript import AUDIT_PREFIX

CONFIG = preset("tiny", vocab_size=300, n_layers=3)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=20)
STEPS = 4
MICRO = 4
MAX_TOKENS = 4096
# what these tests judge is the findings on frames the auditor has: a fetch that outlasts the production timeout
# (3 s) on a loaded 2-core box would make an honest sample inconclusive, which is not what is under test here
FETCH_TIMEOUT_S = 30.0


@contextmanager
def signed_dhts(n: int) -> Iterator[tuple[list[hivemind.DHT], list[Identity]]]:
    """``n`` DHTs on 127.0.0.1 whose p2pd identities are Ed25519 keys this process holds (to sign with)."""
    with tempfile.TemporaryDirectory() as tmp:
        identities = [Identity.generate() for _ in range(n)]
        paths = []
        for i, ident in enumerate(identities):
            path = Path(tmp) / f"id{i}.key"
            path.write_bytes(ident.to_file_bytes())
            paths.append(str(path))
        first = hivemind.DHT(start=True, host_maddrs=LOOPBACK, identity_path=paths[0], check_if_identity_free=False)
        peers = [str(a) for a in first.get_visible_maddrs()]
        nodes = [first, *(hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=peers, identity_path=p,
                                       check_if_identity_free=False)
                          for p in paths[1:])]
        try:
            yield nodes, identities
        finally:
            for d in nodes:
                d.shutdown()


def codec(wire: str = "fp32") -> Any:
    return make_codec(CodecConfig("dense", wire_dtype=wire), CONFIG.d_model, CONFIG.vocab_size, CONFIG.max_seq_len)


def stages() -> list[Any]:
    full = initial_state(CONFIG, 0)
    out = split(CONFIG, 3)
    for s in out:
        load_from_full(s, full)
    return out


@pytest.fixture(scope="module")
def network() -> Iterator[tuple[list[hivemind.DHT], list[Identity]]]:
    with signed_dhts(4) as net:
        yield net


def run_swarm(network: tuple[list[hivemind.DHT], list[Identity]], lie: tuple[str, str, int] | None,
              wire: str = "fp32", samples: int = 2, seeds: tuple[int, ...] = (0,),
              later: int = 0, later_chance: float = 1.0, audited: int = 1, turns: Turns | None = None,
              fetches: list[str] | None = None, withdraw: bool = False,
              audits: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
    """STEPS steps of a 3-stage swarm in round 0 (stage 1 lying as ``lie`` says), then the verdicts of an audit
    of stage ``audited`` (1, or 0: the driver) per seed with ``samples`` samples of the phase's first step (and
    ``later`` of one later step), and the micro-batch attempts it lied on. ``turns``: the auditor's; ``fetches``:
    the name of every blob the auditor fetches is appended there. ``withdraw``: the audited peer takes its phase
    of round 0 back after it (as after a resync); ``audits``: each :class:`PeerAudit` is appended there."""
    dhts, identities = network
    workers = [StageWorker(s, OPTIM, torch.device("cpu")) for s in stages()]
    middle: Any = workers[1] if lie is None else LyingWorker(workers[1], *lie)
    members: set[str] = set()
    notaries = [Notary(i) for i in identities[:3]]
    body = max_body_bytes(codec(wire), MAX_TOKENS, CONFIG.vocab_size)
    servers = [StageServer(dhts[k], w, codec(wire), CONFIG.vocab_size, lambda p: p in members, MAX_TOKENS,
                           notary=notaries[k]) for k, w in ((1, middle), (2, workers[2]))]
    members.update(s.peer_id for s in servers)
    driver = Driver(dhts[0], workers[0], codec(wire), CONFIG.vocab_size, DriverConfig(micro_batches=MICRO),
                    lambda: [[Candidate(servers[0].peer_id, 1.0)], [Candidate(servers[1].peer_id, 1.0)]],
                    MAX_TOKENS, notary=notaries[0])
    members.add(driver.peer_id)
    transports = [P2PBlobTransport(d) for d in dhts]
    try:
        for t, n in zip(transports, notaries):
            t.put_lazy_prefix(AUDIT_PREFIX, n.transcript.resolve)
        for n in notaries:
            n.transcript.phase_started(0)
        torch.manual_seed(7)
        for step in range(STEPS):
            x = torch.randint(0, CONFIG.vocab_size, (8, 17))
            driver.train_step(x[:, :-1], x[:, 1:], step, lr_at(step, OPTIM), round_r=0, inner=step)
        if withdraw:
            assert notaries[audited].transcript.withdraw_phase(0)
        def fetch(peer: str, name: str, *args: Any, **kwargs: Any) -> bytes:
            if fetches is not None:
                fetches.append(name)
            return transports[3].fetch(peer, name, *args, **kwargs)

        auditor = Auditor(fetch, codec(wire), CONFIG.vocab_size, body,
                          AuditConfig(samples=samples, later=later, later_chance=later_chance,
                                      timeout_s=FETCH_TIMEOUT_S), turns)
        # round 0's anchor: the run's initial weights, run through a skeleton of the stage (no parameter memory)
        anchor = initial_state(CONFIG, 0)
        swarm = [driver.peer_id, *(s.peer_id for s in servers)]
        lied = list(getattr(middle, "lied", []))
        verdicts = []
        accused = servers[0].peer_id if audited == 1 else driver.peer_id
        sides = {driver.peer_id: -1, servers[1].peer_id: 1} if audited == 1 else {servers[0].peer_id: 1}
        for seed in seeds:
            found = auditor.audit_peer(0, accused, skeleton(split(CONFIG, 3)[audited]), swarm, seed=seed,
                                       params=anchor)
            assert found.neighbours == set(sides) and found.sides == sides  # its chain in the round, each side
            # every exchange went both ways, and each holder's transcript lists it
            assert found.reached == found.fed_by == set(sides)
            verdicts += found.verdicts
            if audits is not None:
                audits.append(found)
        return verdicts, lied
    finally:
        for t in transports:
            t.close()
        driver.close()
        for s in servers:
            s.close()


def test_the_driver_is_recomputed_exactly_from_its_signed_tokens_on_its_first_step_only(network: Any) -> None:
    """Stage 0's input is read from the token window it signed (the dense codec carries no ids); its later steps
    are not drawn, since the embedding rows a micro-batch reads drift apart from another's."""
    verdicts, _ = run_swarm(network, None, samples=MICRO, later=MICRO, seeds=(0, 1), audited=0)
    assert len(verdicts) == 2 * MICRO
    for v in verdicts:
        assert v.result.inner == 0 and v.result.finding is Finding.CLEAN, v
        assert v.result.forward is not None and v.result.forward.error < 1e-5  # exact: its own tokens, the anchor
        assert set(v.holders) == {"y", "g_out"}


def test_an_honest_middle_stage_passes_every_sample(network: Any) -> None:
    verdicts, _ = run_swarm(network, None, samples=MICRO, later=MICRO, seeds=tuple(range(8)))
    first = [v for v in verdicts if v.result.inner == 0]
    assert {v.micro_batch for v in first} == {v.micro_batch for v in first[:MICRO]} and len(first[:MICRO]) == MICRO
    assert {v.result.inner for v in verdicts} == set(range(STEPS))  # the seeds drew every later step
    worst: dict[int, tuple[float, float, float]] = {}
    for v in verdicts:
        assert v.result.finding is Finding.CLEAN, v  # every later step's siblings were informative, and alike
        assert set(v.holders) == {"x", "y", "g_out", "g_in"}
        for c in (v.result.forward, v.result.backward):
            e, cos, ratio = worst.get(v.result.inner, (0.0, 1.0, 1.0))
            worst[v.result.inner] = (max(e, c.error), min(cos, c.token_cosine),
                                     max(ratio, c.token_ratio, 1 / c.token_ratio))
    print("honest frames against the anchor, by inner step: (worst error, per-token cosine, norm ratio)", worst)
    assert worst[0][0] < 1e-5  # the phase's first step is at the anchor: exact up to float reduction order


def test_an_audit_fetches_its_evidence_beside_a_training_step_and_recomputes_only_in_its_turn(network: Any) -> None:
    """A coordinator's audits run in its exchange thread beside its training steps: every frame is fetched while a
    step runs, and the recomputation (the stage's parameters read, its forward and backward) waits for the step's
    end instead of adding its memory to the step's peak (hlbp.peer.train.turns)."""
    turns = Turns()
    fetches: list[str] = []
    seen: dict[str, Any] = {}
    release = threading.Event()

    def step() -> None:  # a training step that lasts until the audit has fetched everything and asked for a turn
        with turns.step():
            release.wait(120)

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not turns.waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["waiting"], seen["fetched"] = turns.waiting, len(fetches)
        time.sleep(0.5)  # nothing more is fetched while it waits: it had everything
        seen["fetched later"] = len(fetches)
        release.set()

    holder = threading.Thread(target=step)
    holder.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        verdicts, _ = run_swarm(network, None, samples=2, turns=turns, fetches=fetches)
    finally:
        release.set()
        holder.join(10)
        watcher.join(10)
    assert seen["waiting"] == 1 and seen["fetched"] == seen["fetched later"] == len(fetches) > 0, (seen, fetches)
    assert len(verdicts) == 2 and all(v.result.finding is Finding.CLEAN for v in verdicts), verdicts


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("how", ["scale", "flip", "noise"])
def test_a_lying_middle_stage_is_found_guilty(network: Any, where: str, how: str) -> None:
    verdicts, lied = run_swarm(network, (where, how, 1))
    assert len(verdicts) == 2 and all(v.result.inner == 0 for v in verdicts)  # judged: the first step's
    expect = Finding.FORWARD if where == "forward" else Finding.BACKWARD
    assert all(v.result.finding is expect for v in verdicts), verdicts
    assert {v.micro_batch for v in verdicts} <= set(lied)


@pytest.mark.parametrize(("where", "how"), [("forward", "noise"), ("forward", "flip"), ("backward", "scale"),
                                            ("backward", "noise")])
def test_a_liar_on_one_micro_batch_in_ten_is_found_guilty_on_each_lie_and_nothing_else(
        network: Any, where: str, how: str) -> None:
    verdicts, lied = run_swarm(network, (where, how, 10), samples=MICRO, later=MICRO, seeds=tuple(range(12)))
    assert len(lied) == 2  # of 16 micro-batches: one in the first step, one in the third
    expect = Finding.FORWARD if where == "forward" else Finding.BACKWARD
    assert {v.micro_batch for v in verdicts} >= set(lied)  # the seeds drew both
    for v in verdicts:
        if v.micro_batch in lied:  # the first step's lie exactly, the later one against its siblings
            assert v.result.finding is expect, v
        else:
            assert v.result.finding is Finding.CLEAN, v
    assert any(v.result.inner > 0 and v.guilty for v in verdicts)


@pytest.mark.parametrize(("where", "how"), [("forward", "noise"), ("forward", "scale"), ("backward", "noise"),
                                            ("backward", "scale")])
def test_a_rare_lie_the_receivers_screen_marked_is_drawn_by_every_audit(network: Any, where: str, how: str) -> None:
    """Default audits (one first-step attempt, two of one later step) of a liar on one micro-batch in ten: its
    neighbour's screen marks the later lie (the first one falls in the screen's warm-up), so every draw holds it."""
    verdicts, lied = run_swarm(network, (where, how, 10), samples=1, later=2, seeds=tuple(range(6)),
                               later_chance=AuditConfig().later_chance)
    later_lie = lied[1]
    assert later_lie[1] > 1  # a step after the first
    per_seed = [verdicts[i:i + 3] for i in range(0, len(verdicts), 3)]
    assert len(per_seed) == 6
    for draw in per_seed:
        found = {v.micro_batch: v for v in draw}
        assert later_lie in found, draw
        assert found[later_lie].result.finding is (Finding.FORWARD if where == "forward" else Finding.BACKWARD)
        # the first step is judged exactly; of a later step's two frames that are not alike either could be the lie
        # (a x10 frame makes its honest sibling as far from it): both convict the peer that signed them
        assert all(v.result.finding is Finding.CLEAN for v in draw if v.result.inner == 0 and v.micro_batch not in lied)


@pytest.mark.parametrize("audited", [0, 1])
def test_a_peer_that_withdrew_its_phase_is_not_recomputed_and_its_chain_is_still_named(network: Any,
                                                                                        audited: int) -> None:
    """A stage peer whose resync replaced the state its phase trained from lists the round as withdrawn: the
    audit fetches none of its frames (a lie among them is not judged either) and still names every peer its frames
    reached, whose work the coordinator leaves out with its own (``judge``)."""
    fetches: list[str] = []
    audits: list[Any] = []
    verdicts, _ = run_swarm(network, ("forward", "noise", 1) if audited == 1 else None, audited=audited,
                            fetches=fetches, withdraw=True, audits=audits)
    assert verdicts == [] and [a.withdrawn for a in audits] == [True]
    assert fetches and all(name.startswith("audit/i/") for name in fetches), fetches
