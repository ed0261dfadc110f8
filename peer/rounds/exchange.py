"""The two halves of a SparseLoCo round after the inner phase, apart so that an overlapped runner can run the
second in the background (:mod:`hlbp.peer.rounds.overlapped`): :meth:`RoundExchange._contribute` encodes, serves
and announces our contribution; :meth:`RoundExchange._exchange` closes the round, applies it to the anchor,
verifies and resyncs. Also the checks on senders that the close makes: bans, and how late a left-out
peer landed. A mixin of :class:`hlbp.peer.rounds.sparseloco.RoundRunner`, whose state it uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from hlbp.peer.rounds.contribution import contribution_to_bytes
from hlbp.peer.rounds.loop import RoundStats
from hlbp.peer.rounds.outer import Contribution
from hlbp.peer.rounds.payloads import payload_name
from hlbp.peer.rounds.rules import widen_for_late
from hlbp.protocol.identity import sha256_hex
from hlbp.protocol.roundrecords import KIND_CONTRIB, ContribNotice, ShardChecks, parse_contrib, round_key

logger = logging.getLogger(__name__)


class RoundExchange:
    """Contribute and exchange one round (see the module docstring); ``self`` is a RoundRunner."""

    def _contribute(self, r: int, stats: RoundStats, steps: int, tokens: int,
                    base: Mapping[str, torch.Tensor]) -> dict[int, Contribution]:
        """Encode, serve and announce our contribution to round r, the pseudo-gradient of the inner phase that
        started from ``base`` (the anchor; under eager overlap the late anchor moved by our previous contribution).
        Nothing when the phase made no step or we are out of sync."""
        local = {n: p.detach() for n, p in self.trainer.model.named_parameters()}
        mine: dict[int, Contribution] = {}
        if not (steps and self.in_sync):
            return mine
        digests, sizes = {}, {}
        for s in self.held:
            names = self.shards[s]
            c = self.outers[s].contribute({n: base[n] for n in names}, {n: local[n] for n in names}, self.me, tokens)
            sent = self.faults.contribution(r, s, c)
            blob = self.faults.payload(r, s, contribution_to_bytes(sent, self.outer_cfg, self.cfg.run_id, r, s),
                                       self.limits[s])
            self.transport.put(payload_name(r, s, self.me), blob)
            digests[s], sizes[s] = sha256_hex(blob), len(blob)
            mine[s] = c
        if not self.stop.is_set():
            # no look-up first whether the round already closed (a round trip on every round's critical path):
            # a late notice is harmless, _close then finds the round closed and withdraws our contribution
            notice = ContribNotice(self.me, r, tokens, digests, sizes)
            self.records.store(round_key(self.cfg.run_id, r, KIND_CONTRIB), notice.to_body(self.cfg.run_id), KIND_CONTRIB)
            stats.contributed = True
        return mine

    def _exchange(self, r: int, stats: RoundStats, mine: dict[int, Contribution]) -> tuple[ShardChecks, bool]:
        """Everything of round r after our contribution: close, apply to the anchor, verify, resync if out of sync.
        Returns our checks and whether the round closed. Fills ``stats`` (``comm_s``: this part's seconds beyond
        waiting for the close). The model is touched only through ``_load_anchor_into_model``."""
        self.payloads.measure_scales(self.anchor, self.shards)
        bytes_in = self._bytes_in
        t2 = time.perf_counter()
        accepted = self._close(r)
        stats.wait_s = time.perf_counter() - t2
        stats.window_s = self.close_window
        t3 = time.perf_counter()
        stats.phases = {"close": stats.wait_s}
        outcome = "left out"
        if accepted is not None:
            stats.members = len(accepted.members)
            stats.banned = sorted(p for p, until in accepted.banned if until > r)
            outcome = self._apply(r, accepted)
            # "failed": the round's result holds our contribution, and the state we sync next will too
            stats.accepted = outcome in ("applied", "failed") and self.me in accepted.senders()
            if outcome == "failed":
                self.in_sync = False
            elif outcome.startswith("refused"):
                stats.refused = outcome
            stats.guard = dict(self.last_ratios)
            stats.copies = list(self.last_copies) if outcome == "applied" else []
        if mine and not stats.accepted:
            for s, c in mine.items():
                self.outers[s].withdraw(c)  # left out, or the round refused: it stays in the error-feedback buffer
            if self.overlapping and accepted is not None:
                # the phase under way started at our notice, which came too late: it catches up (loop._inner_phase)
                self.catch_up_round = max(self.catch_up_round, r + 1)
        self._load_anchor_into_model()
        if self.overlapped is not None and self.in_sync:
            self.overlapped.preview(r, final=True)  # the phase under way can land the result before it is verified
        checks = self._my_checks(r)
        stats.checksums = checks.checksums
        t4 = time.perf_counter()
        stats.phases["apply"] = t4 - t3
        if accepted is not None and self.in_sync:
            self.faults.applied(r)
            self._publish_state(checks, {p for p, _t, _d in accepted.members})
            t5 = time.perf_counter()
            self.in_sync = self._verify(r, {p: set(d) for p, _t, d in accepted.members}, checks)
            if self.in_sync:
                self.check_followed(r)
            stats.phases.update(publish=t5 - t4, verify=time.perf_counter() - t5)
        self.payloads.forget_through(r)
        if not self.overlapping and (accepted is not None or not self.stop.is_set()):
            self.round = r + 1  # a round abandoned on SIGTERM is not ours to count: a restart syncs past it
        if not self.in_sync:
            logger.warning("round %d: this peer is out of sync; reloading state from peers", r)
            stats.synced = self.sync()
            if stats.synced:  # report the state we now hold, not the one we discarded
                stats.state_round = self.round - 1
                checks = self._my_checks(stats.state_round)
                stats.checksums = checks.checksums
        stats.in_sync = self.in_sync
        stats.comm_s = time.perf_counter() - t3
        stats.bytes_received = self._bytes_in - bytes_in
        return checks, accepted is not None

    def _widen_for_late(self) -> None:
        """Let the next window take back a peer that missed the last close by a little (rules.widen_for_late).

        Its notice still lands after the close, pushed to us (the inbox notes when), and it is parsed and checked
        like any other. The adaptive window only sees on-time arrivals, so without this a peer landing just after
        each close (a restarted one catching up on a busy machine) was left out round after round. A notice that
        reaches us only through the DHT poll gives no time and widens nothing.
        """
        if self._closed_at is None:
            return
        r, first, window, accepted = self._closed_at
        self._closed_at = None
        key = round_key(self.cfg.run_id, r, KIND_CONTRIB)
        landed = self.records.inbox.arrived(key)
        late = {s: b for s, b in self.records.inbox.entries(key).items()
                if s in landed and s not in accepted and s != self.me and not self._banned(s, r)
                and not self.payloads.unreachable(r, s)}  # left out for its payload, not its timing
        if not late:
            return
        offsets = {n.sender: landed[n.sender] - first for n in self.records.records(key, parse_contrib, late, round_=r)}
        wider = widen_for_late(self.window, window, list(offsets.values()), self.cfg.max_deadline_s)
        if wider > self.window:
            logger.info("round %d: %s landed %.1f s after the first contribution, past the %.1f s window; the next "
                        "window is %.1f s", r, ", ".join(s[:16] for s in offsets), max(offsets.values()), window,
                        wider)
            self.window = wider

    def _banned(self, sender: str, r: int) -> bool:
        return sender in self.bans and r < self.bans[sender][0]

    def _refused_by_all(self, peer: str, r: int) -> bool:
        """Whether ``peer`` sent what made every peer's guard refuse a round (the same verdict everywhere, unlike
        a coordinator's word in a travelling ban): such a peer no longer coordinates while banned."""
        return peer in self.guard_bans and r < self.guard_bans[peer]
