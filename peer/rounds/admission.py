"""Admission: a coordinator fetches and checks every contribution before it accepts it, and a member checks the
bans an accepted set carries before it takes any. The :class:`~hlbp.peer.rounds.closer.Closer` owns one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Protocol

from hlbp.peer.net.transport import TransportError
from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.payloads import Payloads, error_text
from hlbp.peer.rounds.rules import coordinator_order
from hlbp.protocol.roundwire import AcceptedSet, ContribNotice

logger = logging.getLogger(__name__)

MAX_NEWCOMER_FETCHES = 32  # parallel fetches at admission when more contributions than fetch_workers are due


@dataclass(frozen=True)
class Refusal:
    """Why a screen leaves a contribution out of the round it coordinates: its sender lied (``ban``), or its work
    was computed on what a liar sent it (left out, not banned). ``undelivered``: a ban for work the sender kept
    failing to deliver as the round's, not for something false it sent; its ban travels marked so
    (:meth:`~hlbp.peer.rounds.bans.RoundBans.ban`, ``missed``) and taints nobody's work."""

    reason: str
    ban: bool
    undelivered: bool = False


class Screen(Protocol):
    """A check of contributions beyond their bytes, run by a coordinator on the ones that passed admission
    (a full replica audits the stage peers' pipeline traffic: hlbp.peer.node.audits)."""

    def refuse(self, r: int, admitted: Mapping[str, ContribNotice]) -> dict[str, Refusal]: ...


class Admission:
    """Fetches and checks contributions for the round loop's closer (``bans``: the loop's, shared)."""

    def __init__(self, me: str, cfg: RoundConfig, n_shards: int, payloads: Payloads, bans: RoundBans,
                 screen: Screen | None = None) -> None:
        self.me, self.cfg, self.n_shards, self.payloads, self.bans = me, cfg, n_shards, payloads, bans
        self.screen = screen
        self._dropped: dict[int, frozenset[str]] = {}  # round -> the screen's refusals without a ban (last few rounds)

    def dropped(self, r: int) -> frozenset[str]:
        """The senders the screen left out of round r without banning them (their work was computed with frames
        it could not take), as the accepted set names them (``AcceptedSet.dropped``)."""
        return self._dropped.get(r, frozenset())

    def check_bans(self, r: int, accepted: AcceptedSet, notices: dict[str, ContribNotice], window: float) -> None:
        """Check the bans round r's accepted set carries, in the background, before taking any: a coordinator's word
        alone bans nobody (one in its turn banned every honest peer for 64 rounds when its bans were honoured).

        A sender the set shows banned whose notice of round r we have and who is no member is checked as if we
        coordinated (:meth:`admit`): garbage, and we ban it ourselves; a contribution that checks out, and the
        accusation is ignored. Bans of senders we cannot reach, or that the set carries from earlier rounds without
        a notice of this one, are not taken either."""
        members = set(accepted.senders())
        accused = {p: notices[p] for p, until in accepted.banned
                   if until > r and p in notices and p not in members and p != self.me and not self.bans.banned(p, r)}
        if not accused:
            return

        def check() -> None:
            # what we cannot fetch, we do not judge; nor is the screen run: this runs beside the round being taken,
            # whose anchor an audit would read half replaced
            cleared = self.admit(r, accused, window, frozenset(), count_misses=False, screened=False)
            if cleared:
                logger.warning("round %d: the accepted set of %s banned %s, whose contributions check out here; "
                               "not taken", r, accepted.coordinator[:16], ", ".join(p[:16] for p in cleared))

        threading.Thread(target=check, name=f"check-bans-{r}", daemon=True).start()

    def admit(self, r: int, notices: dict[str, ContribNotice], window: float, prior: frozenset[str],
              count_misses: bool = True, screened: bool = True) -> dict[str, ContribNotice]:
        """The coordinator fetches and decodes every contribution before accepting it, so one peer's garbage
        cannot make the others fail the round. A sender of garbage is banned for 2, 4, 8, ... rounds. Senders are
        checked in parallel: the round closes for everybody only when the coordinator is done. Then the screen, if
        any and ``screened``, may leave out more (:class:`Screen`)."""
        candidates = {}
        for sender, notice in notices.items():
            if (self.bans.banned(sender, r) or not notice.digests
                    or not set(notice.digests) <= set(range(self.n_shards)) or self.payloads.unreachable(r, sender)):
                continue
            over = [s for s, size in notice.sizes.items() if size > self.payloads.limits[s]]
            if over:  # its own signed notice claims more bytes than any honest payload: refuse without fetching
                self.bans.ban(r, sender, f"announced {notice.sizes[over[0]]:,} bytes for shard {over[0]}, above the "
                                     f"limit of {self.payloads.limits[over[0]]:,}")
                continue
            candidates[sender] = notice

        def check(sender: str) -> Exception | None:
            self.payloads.await_prefetch(r, sender)
            return self.payloads.check(r, sender, candidates[sender].digests)

        # ourselves and last round's members first, each fetch as long as it takes (bounded by the fetch timeout);
        # anyone else only within the window: notices under fresh keys for payloads that exist nowhere stretched a
        # round's close to 43 s (40 keys) while every fetch ran into its timeout
        known = [p for p in candidates if p == self.me or p in prior]
        others = [p for p in coordinator_order(r, list(candidates)) if p not in set(known)]
        started = time.monotonic()
        pool = ThreadPoolExecutor(max(self.cfg.fetch_workers, min(len(candidates), MAX_NEWCOMER_FETCHES)))
        try:
            futures = {p: pool.submit(check, p) for p in [*known, *others]}
            wait_futures([futures[p] for p in known])
            wait_futures([futures[p] for p in others], timeout=max(0.0, started + window - time.monotonic()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # an undelivered fetch ends at its own timeout
        outcomes = {p: f.result() if f.done() and not f.cancelled()
                    else TransportError(f"not delivered within the {window:.1f} s window")
                    for p, f in futures.items()}
        admitted = {}
        for sender, exc in outcomes.items():
            if exc is None:
                admitted[sender] = candidates[sender]
            elif isinstance(exc, TransportError):
                # unreachable, slow or a broken transfer: left out of this round (not retried while we wait for
                # more contributors, each try costs a fetch timeout); a second miss soon after bans the sender
                self.payloads.mark_unreachable(r, sender)
                logger.warning("round %d: could not fetch the contribution of %s (%s); leaving it out", r,
                               sender[:16], error_text(exc))
                if count_misses:
                    self.bans.miss(r, sender)
            else:
                # bytes that match the sender's signed digest yet do not decode or break a bound, or a response
                # that breaks the transfer protocol (a body above the limit): the sender sent garbage
                self.bans.ban(r, sender, error_text(exc))
        for sender, reason in self.payloads.outliers(r, set(admitted)).items():
            self.bans.ban(r, sender, reason)
            del admitted[sender]
        if self.screen is not None and screened and admitted:
            dropped = set()
            for sender, refusal in self.screen.refuse(r, dict(admitted)).items():
                if refusal.ban:
                    self.bans.ban(r, sender, refusal.reason, missed=refusal.undelivered)
                else:
                    logger.warning("round %d: leaving out the contribution of %s: %s", r, sender[:16], refusal.reason)
                    dropped.add(sender)
                admitted.pop(sender, None)
            self._dropped = {**{k: v for k, v in self._dropped.items() if r - 4 < k < r}, r: frozenset(dropped)}
        return admitted

