"""The outer-round protocol between full replicas: contribute, agree on an accepted set, apply, verify.

One round r, as every replica runs it:

1. Inner phase: H AdamW steps from the round's anchor θ(r), cut short if round r has already closed without us.
2. Contribute: encode one SparseLoCo (or DiLoCo) payload per shard, serve it on the data plane, and store a
   signed notice (digest, size, tokens) in the DHT.
3. Close: the contributors are ranked by rendezvous hashing of (round, peer id). The first-ranked one publishes the
   signed accepted set when every expected contributor has arrived or the adaptive window after the first arrival
   has passed; the k-th ranked one takes over after k further ``takeover_s`` if nothing appeared. Everybody applies
   the set of the best-ranked coordinator that published one. A straggler is never waited for: its unsent
   pseudo-gradient goes back into its error-feedback buffer.
4. Apply: fetch every accepted payload (from any peer that already holds it, the sender last, so a weak uploader
   sends it about once), check its digest against the accepted set, and apply in sender order: identical inputs
   give bit-identical parameters on every peer.
5. Verify: publish a checksum of every shard. A peer whose checksum differs from the majority, or that could not
   fetch an accepted payload, is out of sync: it reloads the state from peers that agree, and contributes with
   weight 0 (not at all) until it has.

The decisions (ranking, windows, which set wins, majorities) are pure functions in :mod:`hlbp.peer.roundrules`.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.checkpoint import load_checkpoint, save_checkpoint
from hlbp.peer.metrics import MetricsLog
from hlbp.peer.outer import Contribution, OuterConfig, make_outer
from hlbp.peer.roundrules import (
    adapt_window,
    coordinator_order,
    majority_checksums,
    payload_limit,
    pick_accepted,
)
from hlbp.peer.statesync import encode_state, fetch_state, shard_checksum, state_name
from hlbp.peer.trainer import InnerTrainer
from hlbp.peer.transport import BlobTransport, TransportError
from hlbp.peer.wire import contribution_from_bytes, contribution_to_bytes
from hlbp.protocol import ProtocolError
from hlbp.protocol.records import Identity, sha256_hex
from hlbp.protocol.roundrecords import (
    KIND_ACCEPTED,
    KIND_CHECKS,
    KIND_CONTRIB,
    MAX_RECORD_BYTES,
    AcceptedSet,
    ContribNotice,
    ShardChecks,
    checks_key,
    parse_accepted,
    parse_checks,
    parse_contrib,
    round_key,
    sign,
)

logger = logging.getLogger(__name__)

# The decisions (ranking, windows, which set wins, majorities) live in hlbp.peer.roundrules as pure functions.

# ---------------------------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RoundConfig:
    """Round protocol settings; the run manifest supplies the first five."""

    run_id: str
    inner_steps: int  # H
    deadline_s: float = 30.0  # first collection window after the first contribution arrives
    min_deadline_s: float = 2.0  # bounds of the adapted window
    max_deadline_s: float = 600.0
    takeover_s: float = 3.0  # a k-th ranked coordinator waits k times this past the window before it takes over
    poll_s: float = 0.1  # DHT polling interval while waiting
    fetch_timeout_s: float = 30.0  # per payload from its sender; other holders get a fifth of it
    checks_wait_s: float = 10.0  # how long to wait for the other members' checksums
    record_ttl_s: float = 900.0  # lifetime of round records in the DHT
    max_payload_bytes: int = 1 << 31  # largest contribution or state blob fetched
    fetch_workers: int = 4  # parallel payload fetches


@dataclass
class RoundStats:
    """What one round cost this peer; the simulate summary aggregates these."""

    round: int
    contributed: bool = False
    accepted: bool = False
    members: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_analytic: bool = False  # dense all-reduce: bytes computed from the group size, not counted
    in_sync: bool = True
    synced: bool = False
    checksums: dict[int, str] = field(default_factory=dict)


class RoundRunner:
    """A full replica's loop of outer rounds over a DHT and a blob transport.

    ``shards`` lists the parameter names of each shard (the manifest's stage partition). ``expected`` returns how
    many contributors to wait for before closing early (the live replicas the control plane knows of).
    """

    def __init__(
        self,
        dht: Any,
        identity: Identity,
        transport: BlobTransport,
        trainer: InnerTrainer,
        outer: OuterConfig,
        shards: Sequence[Sequence[str]],
        cfg: RoundConfig,
        stop: threading.Event,
        checkpoint: Path | None = None,
        metrics: MetricsLog | None = None,
        expected: Callable[[], int] | None = None,
        on_round: Callable[[RoundStats, float | None], None] | None = None,
        evaluate: Callable[[], float] | None = None,
        delay_s: float = 0.0,
        corrupt: bool = False,
        oversize: bool = False,
        protect: Callable[[dict[str, tuple[str, int]]], None] | None = None,
    ) -> None:
        self.dht, self.identity, self.transport, self.trainer = dht, identity, transport, trainer
        self.me = identity.peer_id
        self.outer_cfg, self.cfg, self.stop = outer, cfg, stop
        self.shards = [list(s) for s in shards]
        self.outers = [make_outer(outer) for _ in self.shards]
        self.shapes = [{n: tuple(self._param(n).shape) for n in s} for s in self.shards]
        self.anchor = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
        self.checkpoint, self.metrics = checkpoint, metrics or MetricsLog(None)
        self.expected = expected
        self.on_round, self.evaluate = on_round, evaluate
        self.delay_s = delay_s  # artificial slowness per inner step: the straggler fault test uses it
        self.protect = protect  # registers round keys with our DHT node's record validator
        self.corrupt = corrupt  # fault injection: serve payloads whose body is garbage (a lying peer)
        self.oversize = oversize  # fault injection: announce and serve payloads above the size limit
        # the largest contribution a shard can honestly need: fp32 values and 16-bit indices for every parameter,
        # plus headers; real SparseLoCo payloads are about 1/150 of this, so it only stops floods
        self.limits = [min(cfg.max_payload_bytes, payload_limit(sum(math.prod(v) for v in shape.values())))
                       for shape in self.shapes]
        self.bans: dict[str, tuple[int, int]] = {}  # sender -> (banned until round, strikes so far)
        self._verified: dict[tuple[int, str, int], Contribution] = {}  # (round, sender, shard) -> checked payload
        self.round = 0  # the next round to run; the anchor is the result of round - 1
        self.in_sync = True
        self.window = cfg.deadline_s
        self.last_members = 0
        self.history: list[RoundStats] = []
        self._bytes_in = 0
        self._logged: set[tuple[str, str]] = set()

    # -- DHT helpers ---------------------------------------------------------------------------------------------

    def _param(self, name: str) -> torch.nn.Parameter:
        return dict(self.trainer.model.named_parameters())[name]

    def _store(self, key: str, body: dict[str, Any], kind: str) -> None:
        from hivemind.utils import get_dht_time

        value = sign(kind, body, self.identity)
        self.dht.store(key, value, get_dht_time() + self.cfg.record_ttl_s, subkey=self.me)

    def _read(self, key: str) -> dict[str, Any]:
        found = self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {k: getattr(v, "value", v) for k, v in found.value.items()}

    def _records(self, key: str, parse: Callable[..., Any], **kw: Any) -> list[Any]:
        out = []
        for subkey, value in self._read(key).items():
            try:
                out.append(parse(value, str(subkey), self.cfg.run_id, **kw))
            except ProtocolError as exc:
                tag = (key, str(subkey))
                if tag not in self._logged:  # log each bad record once, not at every poll
                    self._logged.add(tag)
                    logger.warning("ignoring a bad round record under %s from %s: %s", key, str(subkey)[:16], exc)
        return out

    def _notices(self, r: int) -> dict[str, ContribNotice]:
        return {n.sender: n for n in self._records(round_key(self.cfg.run_id, r, KIND_CONTRIB), parse_contrib,
                                                   round_=r)}

    def _accepted(self, r: int, order: Sequence[str] = ()) -> AcceptedSet | None:
        sets = self._records(round_key(self.cfg.run_id, r, KIND_ACCEPTED), parse_accepted, round_=r)
        return pick_accepted(sets, order or coordinator_order(r, [s.coordinator for s in sets]))

    def _protect(self, r: int) -> None:
        """Have our DHT node refuse unsigned or mis-signed records under this round's keys, so a forgery with a
        later expiration cannot shadow a real record (hivemind keeps the latest-expiring value per subkey)."""
        if self.protect is None:
            return
        run = self.cfg.run_id
        keys = {round_key(run, r, KIND_CONTRIB): (KIND_CONTRIB, MAX_RECORD_BYTES),
                round_key(run, r, KIND_ACCEPTED): (KIND_ACCEPTED, MAX_RECORD_BYTES),
                checks_key(run): (KIND_CHECKS, MAX_RECORD_BYTES)}
        try:
            self.protect(keys)
        except Exception as exc:  # noqa: BLE001 - readers still verify every record; this is defence in depth
            logger.warning("could not register round %d keys with the DHT validator: %s", r, exc)

    def latest_checks(self) -> list[ShardChecks]:
        return self._records(checks_key(self.cfg.run_id), parse_checks)

    # -- state -----------------------------------------------------------------------------------------------

    def _load_anchor_into_model(self) -> None:
        with torch.no_grad():
            for n, p in self.trainer.model.named_parameters():
                p.copy_(self.anchor[n])

    def _publish_state(self, mine: ShardChecks) -> None:
        """Serve our state after round ``mine.round`` and publish its checksums (and fingerprints)."""
        r = mine.round
        for s in range(len(self.shards)):
            self.transport.put(state_name(r, s), encode_state(self.anchor, self.shards[s], self.outers[s].state_tensors()))
        self.transport.drop([state_name(r - 2, s) for s in range(len(self.shards))])
        self._store(checks_key(self.cfg.run_id), mine.to_body(self.cfg.run_id), KIND_CHECKS)

    # -- agreement: exact checksums here; the dense runner compares fingerprints ------------------------------

    def _fingerprints(self) -> dict[int, tuple[float, float]]:
        """Fingerprints to publish beside the checksums (none: a sparse run agrees bit for bit)."""
        return {}

    def _agreed(self, checks: Sequence[ShardChecks], r: int) -> tuple[list[str], dict[str, dict[int, str]]] | None:
        """The peers holding the agreed state after round r and the checksum to expect from each, or None."""
        want = majority_checksums(checks, r)
        if len(want) != len(self.shards):
            return None
        donors = [c.peer for c in checks if c.round == r and c.checksums == want]
        return donors, {d: want for d in donors}

    def _agrees(self, checks: Sequence[ShardChecks], mine: ShardChecks) -> bool:
        """Whether our state after ``mine.round`` is the one most peers hold."""
        want = majority_checksums([*checks, mine], mine.round)
        if want != mine.checksums:
            bad = [s for s in mine.checksums if want.get(s) != mine.checksums[s]]
            logger.warning("round %d: shard checksums %s differ from the majority of %d peers", mine.round, bad,
                           len([c for c in checks if c.round == mine.round]) + 1)
            return False
        return True

    def _my_checks(self, r: int) -> ShardChecks:
        checks = {s: shard_checksum(self.anchor, names) for s, names in enumerate(self.shards)}
        return ShardChecks(self.me, r, checks, self._fingerprints())

    def sync(self, attempts: int = 3) -> bool:
        """Load the newest agreed state from peers: shards in parallel from different donors, verified by checksum.

        Returns False if no agreed state exists yet (a fresh run) or every bounded attempt failed.
        """
        for _attempt in range(attempts):
            checks = [c for c in self.latest_checks() if c.peer != self.me]
            if not checks:
                # nobody holds an agreed state (every peer failed the same round): ours is as good as any
                self.in_sync = True
                return False
            latest = max(c.round for c in checks)
            agreed = self._agreed(checks, latest)
            if agreed is None or not agreed[0]:
                return False
            donors, expect = agreed
            random.Random(f"{self.me}|{latest}").shuffle(donors)

            try:
                states, n_bytes = fetch_state(self.transport, donors, latest, self.shapes, expect,
                                              self.cfg.max_payload_bytes, self.cfg.fetch_timeout_s,
                                              self.cfg.fetch_workers)
            except TransportError as exc:
                logger.warning("state sync for round %d failed (%s); retrying", latest, exc)
                continue
            self._bytes_in += n_bytes
            for s, state in enumerate(states):
                self.anchor.update({n: t.clone() for n, t in state.params.items()})
                fresh = make_outer(self.outer_cfg)
                fresh.load_state(state.outer)
                self.outers[s] = fresh  # a synced peer starts with an empty error-feedback buffer
            self._load_anchor_into_model()
            self.round, self.in_sync = latest + 1, True
            logger.info("synced state of round %d from %d donors", latest, len(donors))
            return True
        return False

    def save(self) -> None:
        if self.checkpoint is None:
            return
        tensors, header = self.trainer.state_tensors()
        tensors.update({f"anchor.{n}": t for n, t in self.anchor.items()})
        for s, o in enumerate(self.outers):
            tensors.update({f"outer{s}.{k}": v for k, v in o.state_tensors().items()})
        save_checkpoint(self.checkpoint, tensors, {**header, "round": self.round, "in_sync": self.in_sync,
                                                   "run": self.cfg.run_id})

    def resume(self) -> bool:
        """Restore this peer's checkpoint if it has one for this run; the caller then checks it is current."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return False
        tensors, header = load_checkpoint(self.checkpoint)
        if header.get("run") != self.cfg.run_id:
            return False
        self.trainer.load_state(tensors, header)
        self.anchor = {n[7:]: t.float() for n, t in tensors.items() if n.startswith("anchor.")}
        for s, o in enumerate(self.outers):
            prefix = f"outer{s}."
            o.load_state({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        self.round = int(header["round"])
        return True

    def start(self) -> str:
        """Resume, sync or start fresh; returns which, for the log."""
        resumed = self.resume()
        self._protect(self.round)
        checks = [c for c in self.latest_checks() if c.peer != self.me]
        if not checks:
            return "resumed from checkpoint" if resumed else "fresh start"
        latest = max(c.round for c in checks)
        if resumed and self.round == latest + 1 and self._agrees(checks, self._my_checks(latest)):
            self._load_anchor_into_model()
            return "resumed from checkpoint (current)"
        if self.sync():
            return f"synced round {self.round - 1} from peers"
        return "fresh start (no agreed state to sync)"

    # -- one round ---------------------------------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> list[RoundStats]:
        done = 0
        while not self.stop.is_set() and (max_rounds is None or done < max_rounds):
            self.history.append(self.run_round())
            done += 1
        self.save()
        return self.history

    def run_round(self) -> RoundStats:
        r = self.round
        stats, steps, tokens, served_before = self._begin_round(r)
        t1 = time.perf_counter()
        local = {n: p.detach() for n, p in self.trainer.model.named_parameters()}
        mine: list[Contribution] = []
        if steps and self.in_sync:
            digests, sizes = {}, {}
            for s, names in enumerate(self.shards):
                c = self.outers[s].contribute({n: self.anchor[n] for n in names}, {n: local[n] for n in names},
                                              self.me, tokens)
                blob = contribution_to_bytes(c, self.outer_cfg, self.cfg.run_id, r, s)
                if self.corrupt:
                    blob = blob[:64] + bytes(b ^ 0x5A for b in blob[64:])
                if self.oversize:
                    blob = blob + bytes(self.limits[s] + 1 - len(blob))
                self.transport.put(f"c/{r}/{s}/{self.me}", blob)
                digests[s], sizes[s] = sha256_hex(blob), len(blob)
                mine.append(c)
            if self._accepted(r) is None and not self.stop.is_set():
                notice = ContribNotice(self.me, r, tokens, digests, sizes)
                self._store(round_key(self.cfg.run_id, r, KIND_CONTRIB), notice.to_body(self.cfg.run_id), KIND_CONTRIB)
                stats.contributed = True
        t2 = time.perf_counter()
        accepted = self._close(r)
        stats.wait_s = time.perf_counter() - t2
        t3 = time.perf_counter()
        if mine and (accepted is None or self.me not in accepted.senders()):
            for s, c in enumerate(mine):
                self.outers[s].withdraw(c)  # left out: the pseudo-gradient stays in the error-feedback buffer
        if accepted is not None:
            stats.members = len(accepted.members)
            stats.accepted = self.me in accepted.senders()
            ok = self._apply(r, accepted)
            if not ok:
                self.in_sync = False
        self._load_anchor_into_model()
        mine = self._my_checks(r)
        stats.checksums = mine.checksums
        if accepted is not None and self.in_sync:
            self._publish_state(mine)
            self.in_sync = self._verify(r, set(accepted.senders()), mine)
        self.transport.drop_prefix(f"c/{r - 2}/")
        self._verified = {k: v for k, v in self._verified.items() if k[0] > r}
        if accepted is not None or not self.stop.is_set():
            self.round = r + 1  # a round abandoned on SIGTERM is not ours to count: a restart syncs past it
        if not self.in_sync:
            logger.warning("round %d: this peer is out of sync; reloading state from peers", r)
            stats.synced = self.sync()
            if stats.synced:  # report the state we now hold, not the one we discarded
                mine = self._my_checks(self.round - 1)
                stats.checksums = mine.checksums
        stats.in_sync = self.in_sync
        stats.comm_s = (time.perf_counter() - t3) + (t2 - t1)
        stats.bytes_sent = self._bytes_served() - served_before
        stats.bytes_received = self._bytes_in
        self.save()
        if accepted is None and self.stop.is_set():
            return stats  # abandoned on SIGTERM: not a round to report
        return self._report(stats, mine, steps)

    def _report(self, stats: RoundStats, mine: ShardChecks, steps: int) -> RoundStats:
        """Score the new parameters, write the round's metrics record and tell the caller."""
        val = self.evaluate() if self.evaluate else None
        extra = {"fingerprints": {str(k): list(v) for k, v in mine.fingerprints.items()}} if mine.fingerprints else {}
        self.metrics.write(event="round", **{k: v for k, v in vars(stats).items() if k != "checksums"},
                           checksums={str(k): v for k, v in mine.checksums.items()}, val_loss=val, steps=steps,
                           **extra)
        if self.on_round:
            self.on_round(stats, val)
        return stats

    def close(self) -> None:
        """Release what the runner started (the dense runner's averager); the transport is the caller's."""

    def _begin_round(self, r: int) -> tuple[RoundStats, int, int, int]:
        """Protect round r's keys, reset the byte counters and run the inner phase: (stats, steps, tokens, bytes
        served so far)."""
        self._protect(r)
        stats = RoundStats(round=r)
        served_before = self._bytes_served()
        self._bytes_in = 0
        t0 = time.perf_counter()
        steps, tokens = self._inner_phase(r)
        stats.compute_s = time.perf_counter() - t0
        return stats, steps, tokens, served_before

    def _inner_phase(self, r: int) -> tuple[int, int]:
        """Up to H inner steps from the anchor, cut short when round r closes without us; (steps, tokens)."""
        tokens0 = self.trainer.tokens
        steps, last_check = 0, 0.0
        for _ in range(self.cfg.inner_steps):
            if self.stop.is_set():
                break
            if time.perf_counter() - last_check > 0.5:
                last_check = time.perf_counter()
                if self._round_closed(r):
                    break  # the round closed without us: stop computing and take its result
            self.trainer.train_step()
            steps += 1
            if self.delay_s:
                time.sleep(self.delay_s)  # the artificial straggler of the fault tests, not synchronisation
        return steps, self.trainer.tokens - tokens0

    def _round_closed(self, r: int) -> bool:
        return self._accepted(r) is not None

    def _bytes_served(self) -> int:
        return self.transport.bytes_served

    def _close(self, r: int) -> AcceptedSet | None:
        """Wait for round r's accepted set, publishing it ourselves when we are the coordinator in charge."""
        first_seen: float | None = None
        arrivals: dict[str, float] = {}
        give_up = time.monotonic() + self.cfg.max_deadline_s + 30 * self.cfg.takeover_s
        expected = max(1, self.expected() if self.expected else self.last_members)
        while not self.stop.is_set():
            now = time.monotonic()
            notices = self._notices(r)
            for sender in notices:
                arrivals.setdefault(sender, now)
            order = coordinator_order(r, list(notices))
            accepted = self._accepted(r, order)
            if accepted is not None:
                for peer, until in accepted.banned:  # bans travel with the accepted set: every coordinator honours them
                    if until > self.bans.get(peer, (0, 0))[0]:
                        self.bans[peer] = (until, self.bans.get(peer, (0, 0))[1] + 1)
                on_time = [arrivals[s] for s in accepted.senders() if s in arrivals]
                if on_time:
                    self.window = adapt_window([t - min(on_time) for t in on_time], self.cfg.min_deadline_s,
                                               self.cfg.max_deadline_s, self.window)
                self.last_members = len(accepted.members)
                return accepted
            if notices:
                first_seen = first_seen if first_seen is not None else now
                if self.me in order:
                    rank = order.index(self.me)
                    due = first_seen + self.window + rank * self.cfg.takeover_s
                    if (rank == 0 and len(notices) >= expected) or now >= due:
                        members = tuple((s, n.tokens, n.digests) for s, n in sorted(self._admit(r, notices).items()))
                        banned = tuple(sorted((p, u) for p, (u, _) in self.bans.items() if u > r))
                        body = AcceptedSet(self.me, r, members, banned).to_body(self.cfg.run_id)
                        self._store(round_key(self.cfg.run_id, r, KIND_ACCEPTED), body, KIND_ACCEPTED)
                        continue
            if now > give_up:
                logger.warning("round %d: nobody closed the round within %.0f s; moving on", r,
                               give_up - (first_seen or give_up))
                return None
            self.stop.wait(self.cfg.poll_s)
        return None

    def _banned(self, sender: str, r: int) -> bool:
        return sender in self.bans and r < self.bans[sender][0]

    def _admit(self, r: int, notices: dict[str, ContribNotice]) -> dict[str, ContribNotice]:
        """The coordinator fetches and decodes every contribution before accepting it, so one peer's garbage
        cannot make the others fail the round. A sender of garbage is banned for 2, 4, 8, ... rounds."""
        admitted = {}
        for sender, notice in notices.items():
            if self._banned(sender, r) or set(notice.digests) != set(range(len(self.shards))):
                continue
            over = [s for s, size in notice.sizes.items() if size > self.limits[s]]
            if over:  # its own signed notice claims more bytes than any honest payload: refuse without fetching
                self._ban(r, sender, f"announced {notice.sizes[over[0]]:,} bytes for shard {over[0]}, above the "
                                     f"limit of {self.limits[over[0]]:,}")
                continue
            try:
                for s, digest in notice.digests.items():
                    if (r, sender, s) not in self._verified:
                        self._verified[(r, sender, s)] = self._decode(r, s, sender, digest, [])
                admitted[sender] = notice
            except TransportError as exc:
                # unreachable, slow or a broken transfer: left out of this round, not punished
                logger.warning("round %d: could not fetch the contribution of %s (%s); leaving it out", r,
                               sender[:16], str(exc)[:160])
            except ProtocolError as exc:
                # bytes that match the sender's signed digest yet do not decode, or a response that breaks the
                # transfer protocol (a body above the limit): the sender sent garbage
                self._ban(r, sender, str(exc)[:160])
        return admitted

    def _ban(self, r: int, sender: str, reason: str) -> None:
        """Reject a sender's contribution and ban it for 2, 4, 8, ... rounds; the ban travels in the accepted set."""
        strikes = self.bans.get(sender, (0, 0))[1] + 1
        self.bans[sender] = (r + 1 + 2**strikes, strikes)
        logger.warning("round %d: rejected the contribution of %s (%s); banned until round %d", r, sender[:16],
                       reason, self.bans[sender][0])

    def _decode(self, r: int, s: int, sender: str, digest: str, holders: list[str]) -> Contribution:
        """One accepted shard payload, fetched (or our own), digest-checked and decoded."""
        if sender == self.me:
            blob = self._own_blob(r, s)
            if blob is None or sha256_hex(blob) != digest:
                raise TransportError("our own contribution is gone or differs from the accepted digest")
        else:
            blob = self._fetch(r, s, sender, digest, holders)
        c = contribution_from_bytes(blob, self.outer_cfg, self.shapes[s], run=self.cfg.run_id, round=r, shard=s)
        if c.sender != sender:
            raise ProtocolError(f"payload claims sender {c.sender[:12]}…, accepted for {sender[:12]}…")
        return c

    def _fetch(self, r: int, shard: int, sender: str, digest: str, holders: list[str]) -> bytes:
        name = f"c/{r}/{shard}/{sender}"
        others = [h for h in holders if h not in (sender, self.me)]
        random.Random(f"{self.me}|{r}|{shard}|{sender}").shuffle(others)
        errors = []
        for peer in [*others[:3], sender, sender]:  # the sender twice: one broken transfer is not a verdict
            timeout = self.cfg.fetch_timeout_s if peer == sender else self.cfg.fetch_timeout_s / 5
            try:
                blob = self.transport.fetch(peer, name, self.limits[shard], timeout)
            except TransportError as exc:
                errors.append(str(exc)[:100])
                continue
            except ProtocolError as exc:  # the response itself broke the protocol (a body above the limit)
                if peer == sender:
                    raise ProtocolError(f"{sender[:12]}… served its contribution out of protocol: {exc}") from None
                errors.append(f"{peer[:12]}…: {str(exc)[:100]}")
                continue
            if sha256_hex(blob) != digest:
                errors.append(f"{peer[:12]}… served bytes that do not match the accepted digest")
                continue
            self._bytes_in += len(blob)
            self.transport.put(name, blob)  # gossip: serve it onwards, so the sender uploads it about once
            return blob
        raise TransportError(f"contribution of {sender[:12]}… for round {r} shard {shard}: " + "; ".join(errors))

    def _apply(self, r: int, accepted: AcceptedSet) -> bool:
        """Fetch, verify and apply the accepted set; False if any accepted payload could not be had."""
        jobs = []
        for sender, _tokens, digests in accepted.members:
            for s in range(len(self.shards)):
                if s not in digests:
                    logger.warning("round %d: accepted member %s lacks shard %d", r, sender[:12], s)
                    return False
                jobs.append((sender, s, digests[s]))
        holders = accepted.senders()

        def get(job: tuple[str, int, str]) -> tuple[str, int, Contribution]:
            sender, s, digest = job
            cached = self._verified.pop((r, sender, s), None)
            return sender, s, cached if cached is not None else self._decode(r, s, sender, digest, holders)

        try:
            with ThreadPoolExecutor(self.cfg.fetch_workers) as pool:
                got = list(pool.map(get, jobs))
        except (TransportError, ProtocolError) as exc:
            logger.warning("round %d: could not obtain an accepted contribution (%s)", r, exc)
            return False
        per_shard: dict[int, list[Contribution]] = {s: [] for s in range(len(self.shards))}
        for sender, s, c in sorted(got, key=lambda g: (g[1], g[0])):
            per_shard[s].append(c)
        for s, names in enumerate(self.shards):
            new = self.outers[s].apply({n: self.anchor[n] for n in names}, per_shard[s])
            self.anchor.update(new)
        return True

    def _own_blob(self, r: int, s: int) -> bytes | None:
        return self.transport.get(f"c/{r}/{s}/{self.me}")

    def _verify(self, r: int, members: set[str], mine: ShardChecks) -> bool:
        """Compare our state after round r with the other members' (waiting a bounded time for their records)."""
        members = members - {self.me}
        deadline = time.monotonic() + self.cfg.checks_wait_s
        checks: list[ShardChecks] = []
        while time.monotonic() < deadline and not self.stop.is_set():
            checks = [c for c in self.latest_checks() if c.round == r]
            if members <= {c.peer for c in checks}:
                break
            self.stop.wait(self.cfg.poll_s)
        return self._agrees([c for c in checks if c.peer != self.me], mine)
