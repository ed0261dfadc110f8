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

The decisions (ranking, windows, which set wins, majorities) are pure functions in :mod:`hlbp.peer.rounds.rules`.
:class:`RoundRunner` sequences the round over parts it owns: :class:`~hlbp.peer.rounds.records.RoundRecords`
(signed records, pushed and in the DHT), :class:`~hlbp.peer.rounds.payloads.Payloads` (fetch, check, decode),
:class:`~hlbp.peer.rounds.closer.Closer` (step 3, with the bans) and :class:`~hlbp.peer.rounds.follow.Follower`
(shards a stage peer keeps a copy of); applying returns a typed :mod:`~hlbp.peer.rounds.outcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hlbp.peer.common import memory
from hlbp.peer.rounds.admission import Screen
from hlbp.peer.rounds.apply import Applier
from hlbp.peer.rounds.beside import BesideLoop
from hlbp.peer.rounds.closer import Closer
from hlbp.peer.rounds.follow import Follower, follow_anchor
from hlbp.peer.rounds.loop import ReplicaBase, RoundConfig, RoundStats
from hlbp.peer.rounds.outcome import Applied, Failed, Refused, RoundOutcome
from hlbp.peer.rounds.outer import Contribution, make_outer
from hlbp.peer.rounds.overlap import Subset
from hlbp.peer.rounds.overlap_loop import OverlapLoop
from hlbp.peer.rounds.payloads import PayloadEncoder, Payloads, payload_name
from hlbp.peer.rounds.rules import Expected, payload_limit
from hlbp.peer.rounds.state import Start
from hlbp.protocol.identity import sha256_hex
from hlbp.protocol.roundwire import KIND_CONTRIB, AcceptedSet, ContribNotice, ShardChecks, round_key

__all__ = ["RoundConfig", "RoundRunner", "RoundStats"]  # the config and stats live with the shared base

logger = logging.getLogger(__name__)




class Taint(Protocol):
    """A stage peer's check that its round's work is poisoned: computed with frames from a peer the round bans (a
    neighbour caught lying). Such a contribution, when the round leaves it out, is dropped instead of kept in the
    error-feedback buffer for a later round, and what the inner optimizer learned from it is forgotten. It also
    takes back the work of a phase that a resync showed was trained from a wrong state (:meth:`withdraw_phase`)."""

    def tainted(self, r: int, banned: Sequence[str]) -> bool:
        """Whether this peer's round-``r`` work was computed with frames from one of ``banned`` (the bans in force
        that round's accepted set carries, less those it marks as for undelivered contributions). Asked once for
        every round that closed, in order, so an implementation can tell the bans the round added from those it
        carried over."""
        ...

    def forget(self) -> None:
        """Clear what the inner optimizer learned from the tainted phase."""
        ...

    def phase_started(self, r: int) -> None:
        """This peer's inner phase of round ``r`` starts, from the state the round loop holds now."""
        ...

    def withdraw_phase(self, r: int) -> None:
        """A resync replaced the state this peer's phase of round ``r`` started from, if that phase is the one
        under way: take its work back from the round's audits (its frames are not at the round's anchor)."""
        ...


@dataclass
class Settled:
    """What :meth:`RoundRunner.settle` leaves for :meth:`RoundRunner.confirm`: the round's accepted set (None: it
    closed without one, or not at all), our checks, when the exchange's own seconds began (after the close), the
    bytes received before it, and whether we published our checks (then ``sample``: a committee's readers)."""

    accepted: AcceptedSet | None
    checks: ShardChecks
    started: float
    bytes_in: int
    published: bool = False
    sample: Sequence[str] | None = None


class RoundRunner(ReplicaBase):
    """A full replica's SparseLoCo rounds: payloads on the blob transport, an accepted set in the DHT.

    ``shards`` lists the parameter names of each shard (the manifest's stage partition). ``expected`` returns how
    many contributors to wait for before closing early (the live replicas the control plane knows of).
    ``follow``: shards this peer does not hold but keeps a bit-identical copy of, by their initial parameters
    (:mod:`hlbp.peer.rounds.follow`; a stage peer of a B or A+drift run follows the embedding's shard).
    ``screen``: what a coordinator checks admitted contributions with beyond their bytes (a full replica: audits of
    the stage peers' pipeline traffic, hlbp.peer.node.audits). ``taint``: how a stage peer tells that its round's
    work was computed with frames from a peer the round bans (:class:`Taint`).

    More than 60 members because the round's steps (contribute, settle, confirm, sync) share one state (anchor,
    records, payloads, closer, follower) that three orders of a round drive: in turn (:meth:`run_round`),
    overlapped (:class:`~hlbp.peer.rounds.overlap_loop.OverlapLoop`) and verified beside the next phase
    (:class:`~hlbp.peer.rounds.beside.BesideLoop`). Each step's work lives in a part the runner owns.
    """

    def __init__(self, *args: Any, follow: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                 screen: Screen | None = None, taint: Taint | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taint = taint
        self.state.anchor.update(follow_anchor(self.shards, self.shapes, self.held, follow or {}))
        self.follower = Follower(sorted(follow or {}), self.shards, self.shapes, self.me, self.transport, self.cfg,
                                 self.outer_cfg)
        self.state.outers.update({s: make_outer(self.outer_cfg) for s in self.follower.follow})
        applied = sorted({*self.held, *self.follower.follow})  # the shards whose accepted contributions we apply
        # the largest contribution a shard can honestly need: fp32 values and 16-bit indices for every parameter,
        # plus headers; real SparseLoCo payloads are about 1/150 of this, so it only stops floods
        limits = [min(self.cfg.max_payload_bytes, payload_limit(sum(math.prod(v) for v in shape.values())))
                  for shape in self.shapes]
        self.encoder = PayloadEncoder(self.outer_cfg, self.cfg.run_id, limits)
        bans = self.state.bans  # shared by the parts that judge senders, and kept in checkpoints
        self.payloads = Payloads(self.me, self.transport, self.cfg, self.outer_cfg, self.shapes, limits, applied,
                                 bans.banned, self._received, self.stop)
        self.applier = Applier(self.me, self.cfg, self.shards, self.held, applied, self.payloads, bans, self.guard_loss,
                               self.load_anchor_into_model)
        self.overlapped: OverlapLoop | BesideLoop | None = None
        if self.cfg.overlap != "none":
            self.overlapped = OverlapLoop(self)
        elif self.cfg.verify_beside and not self.follower.follow:  # a follower's table may change after it
            self.overlapped = BesideLoop(self)
        # contributors to wait for before closing early: the live ones the announcements name (0: unread), else
        # the last round's members; at every poll an overlapped phase takes in the round's result so far
        self.closer = Closer(self.me, self.cfg, len(self.shards), self.records, self.payloads, bans,
                             lambda: self.expected() if self.expected else Expected(max(1, self.last_members)), self.stop,
                             on_poll=lambda r: self.overlapped.preview(r) if self.overlapped is not None else None,
                             standing=self.state.standing, screen=screen,
                             learned=self.state.window)

    def start(self) -> Start:
        how = super().start()
        if self.state.round > 0:
            self.check_followed(self.state.round - 1)  # a resumed copy (or the seed's) may be behind its holders
        return how

    def sync(self, attempts: int = 3, pause_s: float = 0.0) -> bool:
        synced = super().sync(attempts, pause_s)
        if synced:
            self.check_followed(self.state.round - 1)
        return synced

    def _received(self, n: int) -> None:
        self._bytes_in += n

    def check_followed(self, r: int) -> None:
        """After round r: bring every followed shard to its holders' majority (:class:`Follower`)."""
        fetched, received = self.follower.check(r, self.state.anchor, self.state.outers, self.records.latest_checks)
        self._bytes_in += received
        if fetched:
            self.load_anchor_into_model()

    def phase_base(self) -> Mapping[str, torch.Tensor]:
        if self.overlapped is not None and self.overlapped.base is not None:
            return self.overlapped.base
        return self.state.anchor

    def _after_step(self, r: int, step: int) -> None:
        if self.overlapped is not None:
            self.overlapped.land()

    def finish_rounds(self) -> RoundStats | None:
        return self.overlapped.finish() if self.overlapped is not None else None

    def quiesce_rounds(self) -> None:
        if self.overlapped is not None:
            self.overlapped.quiesce()

    def run_round(self) -> RoundStats | None:
        if self.overlapped is not None:
            return self.overlapped.run_round()
        r = self.state.round
        stats, steps, tokens, served_before = self.begin_round(r)
        # where the phase started, read back after the round replaces the anchor, for a taint to take it back
        start = self.state.anchor.snapshot() if self.taint is not None else None
        t1 = time.perf_counter()
        mine = self.contribute(r, stats, steps, tokens, self.state.anchor)
        encode_s = time.perf_counter() - t1
        checks, closed = self.exchange(r, stats, mine, start)
        stats.phases = {"encode": encode_s, **stats.phases}
        stats.comm_s += encode_s
        stats.bytes_sent = self.bytes_served() - served_before
        self.save_if_due()
        if not closed and self.stop.is_set():
            return stats  # abandoned on SIGTERM: not a round to report
        return self.report(stats, checks, steps)

    def round_closed(self, r: int, wait: bool = True) -> bool:
        return self.closer.round_closed(r, wait)

    def round_started(self, r: int, wait: bool = True) -> bool:
        return self.closer.round_started(r, wait)

    def holding_up(self, r: int) -> bool:
        return self.closer.holding_up(r)

    def contribute(self, r: int, stats: RoundStats, steps: int, tokens: int,
                    base: Mapping[str, torch.Tensor]) -> dict[int, Contribution]:
        """Encode, serve and announce our contribution to round r, the pseudo-gradient of the inner phase that
        started from ``base`` (the anchor; under eager overlap the late anchor moved by our previous contribution).
        Nothing when the phase made no step or we are out of sync."""
        local = {n: p.detach() for n, p in self.trainer.model.named_parameters()}
        mine: dict[int, Contribution] = {}
        if not (steps and self.state.in_sync):
            return mine
        digests, sizes = {}, {}
        for s in self.held:
            names = self.shards[s]
            c = self.state.outers[s].contribute(Subset(base, names), {n: local[n] for n in names}, self.me, tokens)
            blob = self.encoder.encode(r, s, c)
            self.transport.put(payload_name(r, s, self.me), blob)
            digests[s], sizes[s] = sha256_hex(blob), len(blob)
            mine[s] = c
        if not self.stop.is_set():
            # no look-up first whether the round already closed (a round trip on every round's critical path):
            # a late notice is harmless, _close then finds the round closed and withdraws our contribution
            if not self.cfg.dialable:  # behind NAT: whoever fetches our payload needs a connection we opened
                self.transport.reach_out()
            notice = ContribNotice(self.me, r, tokens, digests, sizes, dialable=self.cfg.dialable)
            # with a committee, pushed to our holder only (closer.notice_targets); else to every live peer
            self.records.store(round_key(self.cfg.run_id, r, KIND_CONTRIB), notice.to_body(self.cfg.run_id),
                               KIND_CONTRIB, only=self.closer.notice_targets(r))
            stats.contributed = True
        memory.trim()  # the encoding's per-parameter buffers go back to the system before the next phase
        return mine

    def exchange(self, r: int, stats: RoundStats, mine: dict[int, Contribution],
                 start: Mapping[str, torch.Tensor] | None = None) -> tuple[ShardChecks, bool]:
        """Everything of round r after our contribution: close, apply to the anchor, verify, resync if out of sync
        (:meth:`settle`, then :meth:`confirm`). Returns our checks and whether the round closed. Fills ``stats``
        (``comm_s``: this part's seconds beyond waiting for the close). The model is touched only through
        ``load_anchor_into_model``. ``start``: where our phase started (default the anchor as it is), what a taint
        subtracts our phase's pseudo-gradient from."""
        settled = self.settle(r, stats, mine, start)
        return self.confirm(r, stats, settled), settled.accepted is not None

    def settle(self, r: int, stats: RoundStats, mine: dict[int, Contribution],
               start: Mapping[str, torch.Tensor] | None = None) -> Settled:
        """Round r up to its verification: close it, apply the accepted set, load the result into the model and
        publish our checksums. What is left (:meth:`confirm`) changes the model only if we turn out out of sync."""
        self.payloads.measure_scales(self.state.anchor, self.shards)
        bytes_in = self._bytes_in
        t2 = time.perf_counter()
        accepted = self.closer.close(r)
        stats.wait_s = time.perf_counter() - t2
        stats.window_s = self.closer.close_window
        t3 = time.perf_counter()
        stats.phases = {"close": stats.wait_s}
        if accepted is not None:
            stats.members = len(accepted.members)
            stats.banned = sorted(p for p, until in accepted.banned if until > r)
            self.last_members = len(accepted.members)
            outcome = self.apply_round(r, accepted)
            self.state.evidence = {} if isinstance(outcome, Failed) else self.closer.proofs.get(r, {})
            # Failed: the round's result holds our contribution, and the state we sync next will too
            stats.accepted = not isinstance(outcome, Refused) and self.me in accepted.senders()
            if isinstance(outcome, Failed):
                self.state.in_sync = False
            elif isinstance(outcome, Refused):
                stats.refused = str(outcome)
            stats.guard = dict(self.applier.last_ratios)
            stats.copies = list(self.applier.last_copies) if isinstance(outcome, Applied) else []
        taint = self.taint
        # asked about every round that closed; a ban for undelivered contributions is no evidence that a peer's
        # frames were false, so it taints nothing
        tainted = taint is not None and accepted is not None and taint.tainted(r, accepted.faulted(r))
        if taint is not None and tainted and mine and not stats.accepted:
            # poisoned by a neighbour caught lying: kept, it would come back in a later round's contribution
            logger.warning("round %d: our contribution was computed with frames from a peer banned for lying; "
                           "dropping it, its phase from the error feedback and the inner optimizer's moments", r)
            stats.tainted = True
            taint.forget()
            self.forget_phase(mine, start)
        elif mine and not stats.accepted and accepted is not None and self.me in accepted.dropped:
            # left out with frames the coordinator could not take (a neighbour's work withdrawn, stale or not
            # checked, perhaps a lie): kept, it would come back unaudited in a later round's contribution
            logger.warning("round %d: our contribution was left out with a chain of frames the coordinator could not "
                           "take; dropping its phase from the error feedback", r)
            stats.dropped = True
            self.forget_phase(mine, start)
        elif mine and not stats.accepted:
            crowded = accepted is not None and not stats.refused and self.closer.selection.full_without(accepted, mine.keys())
            if not (crowded and self.cfg.unselected == "drop"):
                for s, c in mine.items():
                    # left out, or the round refused: it stays in the error-feedback buffer
                    self.state.outers[s].withdraw(c)
            # a contribution the gather set had no room for is dropped by default, as templar's miners drop theirs:
            # kept, its stale mass measured worse at equal tokens (docs/results.md, "Gather set")
            if self.overlapping and accepted is not None and not crowded:
                # the phase under way started at our notice, which came too late: it catches up (InnerPhase.run);
                # a contribution the gather set had no room for came in time, and its phase runs on
                self.phase.catch_up_round = max(self.phase.catch_up_round, r + 1)
        self.load_anchor_into_model()
        if self.overlapped is not None and self.state.in_sync:
            self.overlapped.preview(r, final=True)  # the phase under way can land the result before it is verified
        checks = self.syncer.checks(self.state, r)
        stats.checksums = checks.checksums
        t4 = time.perf_counter()
        stats.phases["apply"] = t4 - t3
        settled = Settled(accepted, checks, t3, bytes_in)
        if accepted is not None and self.state.in_sync:
            settled.published = True
            settled.sample = self.closer.check_peers(r)  # with a committee: whose checksums we read (None: members')
            self.syncer.publish(self.state, checks, {p for p, _t, _d in accepted.members},
                                sampled=settled.sample is not None)
            stats.phases["publish"] = time.perf_counter() - t4
        return settled

    def forget_phase(self, mine: Mapping[int, Contribution], start: Mapping[str, torch.Tensor] | None) -> None:
        """Take the phase that made ``mine`` (started at ``start``, default the anchor) out of the error-feedback
        buffers: what top-k did not send of it is in there too (:meth:`~hlbp.peer.rounds.outer.Outer.forget_phase`)."""
        local = {n: p.detach() for n, p in self.trainer.model.named_parameters()}  # where the phase ended
        begin = start if start is not None else self.state.anchor
        for s, c in mine.items():
            names = self.shards[s]
            self.state.outers[s].forget_phase(c, Subset(begin, names), {n: local[n] for n in names})

    def confirm(self, r: int, stats: RoundStats, settled: Settled) -> ShardChecks:
        """The rest of round r after :meth:`settle`: compare our checksums with the members', follow the followed
        shards, and resync when out of sync. Returns our checks (the synced state's, after a resync)."""
        accepted, checks = settled.accepted, settled.checks
        if settled.published and accepted is not None:
            t5 = time.perf_counter()
            self.state.in_sync = self.syncer.verify(r, {p: set(d) for p, _t, d in accepted.members}, checks,
                                                    settled.sample)
            if self.state.in_sync:
                self.check_followed(r)
            stats.phases["verify"] = time.perf_counter() - t5
        self.payloads.forget_through(r)
        if not self.overlapping and (accepted is not None or not self.stop.is_set()):
            self.state.round = r + 1  # a round abandoned on SIGTERM is not ours to count: a restart syncs past it
        if not self.state.in_sync:
            logger.warning("round %d: this peer is out of sync; reloading state from peers", r)
            self.closer.selection.forget(r)  # what we recorded may hold a set the others did not take
            self.closer.seating.forget()  # and so may the committees we drew from them
            stats.synced = self.sync()
            if stats.synced:  # report the state we now hold, not the one we discarded
                stats.state_round = self.state.round - 1
                checks = self.syncer.checks(self.state, stats.state_round)
                stats.checksums = checks.checksums
        stats.in_sync = self.state.in_sync
        stats.comm_s = time.perf_counter() - settled.started
        stats.bytes_received = self._bytes_in - settled.bytes_in
        return checks

    def close(self) -> None:
        self.payloads.close()
        super().close()

    def apply_round(self, r: int, accepted: AcceptedSet) -> RoundOutcome:
        """Apply round r's accepted set to our state (:class:`~hlbp.peer.rounds.apply.Applier`)."""
        return self.applier.apply(r, accepted, self.state, self.closer.online[1])
