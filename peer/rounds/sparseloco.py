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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds import copies, guard
from hlbp.peer.rounds.exchange import RoundExchange
from hlbp.peer.rounds.follow import Follower, follow_anchor
from hlbp.peer.rounds.inbox import DhtPoll
from hlbp.peer.rounds.loop import ReplicaBase, RoundConfig, RoundStats
from hlbp.peer.rounds.outer import Contribution, make_outer
from hlbp.peer.rounds.overlapped import Overlapped
from hlbp.peer.rounds.payloads import BadPayload, Payloads, error_text
from hlbp.peer.rounds.rules import (
    adapt_window,
    close_verdict,
    coordinator_order,
    coordinator_ranking,
    payload_limit,
    pick_accepted,
)
from hlbp.protocol import ProtocolError
from hlbp.protocol.roundrecords import (
    KIND_ACCEPTED,
    KIND_CONTRIB,
    AcceptedSet,
    ContribNotice,
    parse_accepted,
    parse_contrib,
    round_key,
)

__all__ = ["RoundConfig", "RoundRunner", "RoundStats"]  # the config and stats live with the shared base

logger = logging.getLogger(__name__)


MAX_TRAVELLING_BAN = 64  # rounds: the longest ban a coordinator's accepted set can impose on the others


class RoundRunner(RoundExchange, ReplicaBase):
    """A full replica's SparseLoCo rounds: payloads on the blob transport, an accepted set in the DHT.

    ``shards`` lists the parameter names of each shard (the manifest's stage partition). ``expected`` returns how
    many contributors to wait for before closing early (the live replicas the control plane knows of).
    ``follow``: shards this peer does not hold but keeps a bit-identical copy of, by their initial parameters
    (:mod:`hlbp.peer.rounds.follow`; a stage peer of a B or A+drift run follows the embedding's shard).
    """

    def __init__(self, *args: Any, follow: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.anchor.update(follow_anchor(self.shards, self.shapes, self.held, follow or {}))
        self.follower = Follower(sorted(follow or {}), self.shards, self.shapes, self.me, self.transport, self.cfg,
                                 self.outer_cfg)
        self.outers.update({s: make_outer(self.outer_cfg) for s in self.follower.follow})
        self.applied = sorted({*self.held, *self.follower.follow})  # the shards whose accepted contributions we apply
        # the largest contribution a shard can honestly need: fp32 values and 16-bit indices for every parameter,
        # plus headers; real SparseLoCo payloads are about 1/150 of this, so it only stops floods
        self.limits = [min(self.cfg.max_payload_bytes, payload_limit(sum(math.prod(v) for v in shape.values())))
                       for shape in self.shapes]
        self.bans: dict[str, tuple[int, int]] = {}  # sender -> (banned until round, strikes so far)
        self.guard_bans: dict[str, int] = {}  # sender -> banned until round, from this peer's own guard refusals
        self.payloads = Payloads(self.me, self.transport, self.cfg, self.outer_cfg, self.shapes, self.limits,
                                 self.applied, self._banned, self._received, self.stop)
        self.guard = self.cfg.guard
        self.last_ratios: dict[str, float] = {}  # the last applied round's largest norm ratios (guard)
        self.last_copies: list[dict[str, Any]] = []  # the last applied round's evidence of copied contributions
        self._reuse = {s: copies.ReuseLog() for s in self.held}
        self.overlapped = Overlapped(self) if self.cfg.overlap != "none" else None
        # the last closed round as we saw it close: (round, its first arrival, its window, the accepted senders),
        # for _widen_for_late (exchange.py)
        self._closed_at: tuple[int, float, float, frozenset[str]] | None = None
        self.close_window = self.window  # the window of the round _close last waited for

    def start(self) -> str:
        how = super().start()
        if self.round > 0:
            self.check_followed(self.round - 1)  # a resumed copy (or the seed's) may be behind its holders
        return how

    def sync(self, attempts: int = 3) -> bool:
        synced = super().sync(attempts)
        if synced:
            self.check_followed(self.round - 1)
        return synced

    def _received(self, n: int) -> None:
        self._bytes_in += n

    def check_followed(self, r: int) -> None:
        """After round r: bring every followed shard to its holders' majority (:class:`Follower`)."""
        fetched, received = self.follower.check(r, self.anchor, self.outers, self.records.latest_checks)
        self._bytes_in += received
        if fetched:
            self._load_anchor_into_model()

    def _round_records(self, r: int, wait: bool = True,
                       poller: DhtPoll | None = None) -> tuple[dict[str, ContribNotice], list[AcceptedSet]]:
        """Round r's contribution notices (by sender) and published accepted sets, read in one concurrent poll
        (``wait``), or as ``poller`` (default: the exchange's) last polled plus what was pushed since."""
        keys = (round_key(self.cfg.run_id, r, KIND_CONTRIB), round_key(self.cfg.run_id, r, KIND_ACCEPTED))
        contribs, accepted = self.records.read(*keys) if wait else (poller or self.records.poller).entries(*keys)
        notices = {n.sender: n for n in self.records.records(keys[0], parse_contrib, contribs, round_=r)}
        self.records.seen(r, notices)
        return notices, self.records.records(keys[1], parse_accepted, accepted, round_=r)

    def _accepted(self, r: int, sets: list[AcceptedSet] | None = None, order: Sequence[str] = ()) -> AcceptedSet | None:
        """The accepted set of round r that every peer applies: the best-ranked coordinator's (``sets``: already
        read; ``order``: the coordinator ranking, from the notices)."""
        if sets is None:
            sets = self.records.records(round_key(self.cfg.run_id, r, KIND_ACCEPTED), parse_accepted, round_=r)
        sets = [x for x in sets if not self._refused_by_all(x.coordinator, r)]
        return pick_accepted(sets, order or coordinator_order(r, [s.coordinator for s in sets]))

    def phase_base(self) -> Mapping[str, torch.Tensor]:
        if self.overlapped is not None and self.overlapped.base is not None:
            return self.overlapped.base
        return self.anchor

    def _between_steps(self) -> None:
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
        r = self.round
        stats, steps, tokens, served_before = self._begin_round(r)
        t1 = time.perf_counter()
        mine = self._contribute(r, stats, steps, tokens, self.anchor)
        encode_s = time.perf_counter() - t1
        checks, closed = self._exchange(r, stats, mine)
        stats.phases = {"encode": encode_s, **stats.phases}
        stats.comm_s += encode_s
        stats.bytes_sent = self._bytes_served() - served_before
        self.save_if_due()
        if not closed and self.stop.is_set():
            return stats  # abandoned on SIGTERM: not a round to report
        return self._report(stats, checks, steps)

    def round_closed(self, r: int, wait: bool = True) -> bool:
        if wait:
            return self._accepted(r) is not None
        return self._accepted(r, self._round_records(r, False, self.records.phase_poller)[1]) is not None

    def round_started(self, r: int, wait: bool = True) -> bool:
        notices, sets = self._round_records(r, wait, self.records.phase_poller)
        return bool(sets) or any(sender != self.me and not self._banned(sender, r) for sender in notices)

    def _close(self, r: int) -> AcceptedSet | None:
        """Wait for round r's accepted set, publishing it ourselves when we are the coordinator in charge."""
        first_seen: float | None = None
        arrivals: dict[str, float] = {}
        give_up = time.monotonic() + self.cfg.max_deadline_s + 30 * self.cfg.takeover_s
        # 0 from the announcements means they could not be read: wait out the window rather than close on the first
        expected = (self.expected() or math.inf) if self.expected else max(1, self.last_members)
        self._widen_for_late()
        self.close_window = self.window
        while not self.stop.is_set():
            now = time.monotonic()
            notices, sets = self._round_records(r, wait=False)
            self.payloads.prefetch(r, notices)
            if self.overlapped is not None:
                self.overlapped.preview(r)  # the round's result as far as it is fetched, for the phase under way
            for sender in notices:
                arrivals.setdefault(sender, now)
            order = coordinator_ranking(r, {p: set(n.digests) for p, n in notices.items()
                                            if not self._refused_by_all(p, r)}, len(self.shards))
            accepted = self._accepted(r, sets, order)
            if accepted is not None:
                for peer, until in accepted.banned:  # bans travel with the accepted set: every coordinator honours them
                    until = min(until, r + 1 + MAX_TRAVELLING_BAN)  # a lying coordinator cannot ban anyone for ever
                    if until > self.bans.get(peer, (0, 0))[0] and peer != self.me:
                        self.bans[peer] = (until, self.bans.get(peer, (0, 0))[1] + 1)
                on_time = [arrivals[s] for s in accepted.senders() if s in arrivals]
                if on_time:
                    self._closed_at = (r, min(on_time), self.window, frozenset(accepted.senders()))
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
                        admitted = self.faults.accept(r, self._admit(r, notices), notices)
                        verdict = close_verdict(len(admitted), self.cfg.min_contributors, now, first_seen,
                                                self.cfg.max_deadline_s, rank, self.cfg.takeover_s)
                        if verdict != "wait":
                            if verdict == "empty":
                                logger.warning("round %d: %d of the %d contributions the run requires arrived within "
                                               "%.0f s; closing it empty (nobody's parameters move)", r,
                                               len(admitted), self.cfg.min_contributors, self.cfg.max_deadline_s)
                                admitted = {}
                            members = tuple((s, n.tokens, n.digests) for s, n in sorted(admitted.items()))
                            banned = tuple(sorted((p, u) for p, (u, _) in self.bans.items() if u > r))
                            body = AcceptedSet(self.me, r, members, banned).to_body(self.cfg.run_id)
                            self.records.store(round_key(self.cfg.run_id, r, KIND_ACCEPTED), body, KIND_ACCEPTED,
                                        set(notices))
                            continue
            if now > give_up:
                logger.warning("round %d: nobody closed the round within %.0f s; moving on", r,
                               give_up - (first_seen or give_up))
                return None
            self.records.inbox.wait(self.cfg.poll_s)  # wakes at once for a pushed record or a finished DHT read
        return None

    def _admit(self, r: int, notices: dict[str, ContribNotice]) -> dict[str, ContribNotice]:
        """The coordinator fetches and decodes every contribution before accepting it, so one peer's garbage
        cannot make the others fail the round. A sender of garbage is banned for 2, 4, 8, ... rounds. Senders are
        checked in parallel: the round closes for everybody only when the coordinator is done."""
        candidates = {}
        for sender, notice in notices.items():
            if (self._banned(sender, r) or not notice.digests
                    or not set(notice.digests) <= set(range(len(self.shards))) or self.payloads.unreachable(r, sender)):
                continue
            over = [s for s, size in notice.sizes.items() if size > self.limits[s]]
            if over:  # its own signed notice claims more bytes than any honest payload: refuse without fetching
                self._ban(r, sender, f"announced {notice.sizes[over[0]]:,} bytes for shard {over[0]}, above the "
                                     f"limit of {self.limits[over[0]]:,}")
                continue
            candidates[sender] = notice

        def check(sender: str) -> Exception | None:
            self.payloads.await_prefetch(r, sender)
            return self.payloads.check(r, sender, candidates[sender].digests)

        with ThreadPoolExecutor(max(1, min(len(candidates), self.cfg.fetch_workers))) as pool:
            outcomes = dict(zip(candidates, pool.map(check, list(candidates))))
        admitted = {}
        for sender, exc in outcomes.items():
            if exc is None:
                admitted[sender] = candidates[sender]
            elif isinstance(exc, TransportError):
                # unreachable, slow or a broken transfer: left out of this round (not retried while we wait for
                # more contributors, each try costs a fetch timeout), not punished
                self.payloads.mark_unreachable(r, sender)
                logger.warning("round %d: could not fetch the contribution of %s (%s); leaving it out", r,
                               sender[:16], error_text(exc))
            else:
                # bytes that match the sender's signed digest yet do not decode or break a bound, or a response
                # that breaks the transfer protocol (a body above the limit): the sender sent garbage
                self._ban(r, sender, error_text(exc))
        return admitted

    def close(self) -> None:
        self.payloads.close()
        super().close()

    def _ban(self, r: int, sender: str, reason: str) -> None:
        """Reject a sender's contribution and ban it for 2, 4, 8, ... rounds; the ban travels in the accepted set."""
        strikes = self.bans.get(sender, (0, 0))[1] + 1
        self.bans[sender] = (r + 1 + 2**strikes, strikes)
        logger.warning("round %d: rejected the contribution of %s (%s); banned until round %d", r, sender[:16],
                       reason, self.bans[sender][0])

    def _apply(self, r: int, accepted: AcceptedSet) -> str:
        """Fetch, verify, bound and apply the accepted set.

        Returns ``"applied"``; ``"refused: ..."`` when the round breaks a bound of :mod:`hlbp.peer.rounds.guard`
        or an accepted payload does not decode (every in-sync peer holds the same bytes and anchor, so every one
        refuses alike, bans the same senders and keeps its parameters); or ``"failed"`` when an accepted payload
        could not be had (this peer alone is then out of sync).
        """
        # each held (or followed) shard takes the members that contributed to it (a stage peer contributes its own
        # shard only)
        jobs = [(sender, s, digests[s]) for sender, _tokens, digests in accepted.members for s in self.applied
                if s in digests]
        holders = accepted.senders()

        def get(job: tuple[str, int, str]) -> tuple[str, int, Contribution | BadPayload | None]:
            sender, s, digest = job
            self.payloads.await_prefetch(r, sender)
            cached = self.payloads.take(r, sender, s, digest)
            if cached is not None:
                return sender, s, cached
            try:
                return sender, s, self.payloads.decode(r, s, sender, digest, holders, accepted.coordinator)
            except BadPayload as exc:
                return sender, s, exc
            except (TransportError, ProtocolError) as exc:
                if s in self.held:
                    raise
                logger.warning("round %d: could not fetch the contribution of %s to followed shard %d (%s); that "
                               "shard waits for its holders' state", r, sender[:16], s, error_text(exc))
                return sender, s, None

        try:
            with ThreadPoolExecutor(self.cfg.fetch_workers) as pool:
                got = list(pool.map(get, jobs))
        except (TransportError, ProtocolError) as exc:
            logger.warning("round %d: could not obtain an accepted contribution (%s)", r, error_text(exc))
            return "failed"
        bad = {sender: str(c) for sender, _s, c in got if isinstance(c, BadPayload)}
        if bad:
            return self._refuse(r, bad, "an accepted contribution does not decode")
        missing = {s for _sender, s, c in got if c is None}  # followed shards only: they are fetched whole later
        per_shard: dict[int, list[Contribution]] = {s: [] for s in self.applied if s not in missing}
        for _sender, s, c in sorted(got, key=lambda g: (g[1], g[0])):
            if s in per_shard:
                per_shard[s].append(c)  # type: ignore[arg-type]
        new: dict[str, torch.Tensor] = {}
        ratios = {"contribution": 0.0, "update": 0.0}  # the largest of the round, reported to measure the bounds
        for s, contributions in per_shard.items():
            names = self.shards[s]
            norms = {c.sender: guard.contribution_norm(c) for c in contributions}
            ratios["contribution"] = max([ratios["contribution"], *(n / self.payloads.scales[s] for n in norms.values())])
            over = guard.oversized(norms, self.payloads.scales[s], self.guard)
            if over:
                return self._refuse(r, {p: f"shard {s}'s contribution norm is {v:.3g}x the shard's parameter norm"
                                        for p, v in over.items()}, "a contribution breaks the norm bound")
            old = {n: self.anchor[n] for n in names}
            shard_new = self.outers[s].apply(old, contributions)
            ratio = guard.update_ratio(old, shard_new)
            ratios["update"] = max(ratios["update"], ratio)
            self.last_ratios = ratios
            reason = guard.refuse_reason(ratio, self.guard)
            if reason:
                blamed = guard.culprits(norms)
                return self._refuse(r, {p: f"largest contribution to shard {s}" for p in blamed},
                                    f"shard {s}: {reason}")
            new.update(shard_new)
        old = {n: self.anchor[n] for n in new}
        self.anchor.update(new)
        if self.guard_loss is not None:
            loss = self.guard_loss(self.anchor)
            reason = guard.loss_reason(self.last_guard_loss, loss, self.guard)
            if reason:
                self.anchor.update(old)
                self._load_anchor_into_model()
                norms = {c.sender: guard.contribution_norm(c) for cs in per_shard.values() for c in cs}
                return self._refuse(r, {p: "largest contribution of a round whose loss exploded"
                                        for p in guard.culprits(norms)}, reason)
            self.last_guard_loss = loss
        self.last_copies = self._copies(r, {s: per_shard[s] for s in self.held})
        return "applied"

    def _copies(self, r: int, per_shard: dict[int, list[Contribution]]) -> list[dict[str, Any]]:
        """Evidence of copied contributions in an applied round (reported, not punished: see rounds/copies.py)."""
        found: list[dict[str, Any]] = []
        largest = 0.0
        for s, contributions in per_shard.items():
            pairs, top = copies.overlapping_pairs(contributions)
            largest = max(largest, top)
            found += [{"kind": "overlap", "shard": s, "peers": [a, b], "overlap": v} for a, b, v in pairs]
            found += [{"kind": "reuse", "shard": s, "peer": p, "first_round": fr, "first_peer": fp}
                      for p, fr, fp in self._reuse[s].check(r, contributions)]
        self.last_ratios["overlap"] = largest
        for item in found:
            logger.warning("round %d: possible copy: %s", r, item)
        return found

    def _refuse(self, r: int, offenders: dict[str, str], why: str) -> str:
        """Refuse round r as a whole (nobody's parameters move) and ban ``offenders`` (sender -> reason)."""
        logger.warning("round %d: refused (%s); keeping the parameters of round %d", r, why, r - 1)
        for sender, reason in sorted(offenders.items()):
            self._ban(r, sender, reason)
            self.guard_bans[sender] = self.bans[sender][0]
        return f"refused: {why}"
