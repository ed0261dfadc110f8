"""Whom a round loop refuses, and until which round: bans for garbage, for undelivered contributions, and for
what made every peer's guard refuse a round.

The bans are this peer's own verdicts, so its checkpoint keeps them (:meth:`RoundBans.to_json`). A peer that
resumes its current state without them counts a banned peer's notices again; in a capped round that puts the banned
peer back in the gather order this peer checks, ahead of the members an honest coordinator took, so it would refuse
that coordinator's set and take another, alone."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

MISS_WINDOW = 8  # rounds: two undelivered contributions within this many ban their sender
MAX_MISSERS = 4096  # senders whose misses are remembered
MAX_SAVED_BANS = 1 << 16  # bans a checkpoint may name


def ban_end(r: int, strikes: int) -> int:
    """The first round after a ban imposed in round ``r`` on its ``strikes``-th strike: 2, 4, 8, ... rounds."""
    return r + 1 + 2**strikes


class RoundBans:
    """Whom this round loop refuses, and until which round.

    ``until``: sender -> (banned until round, strikes so far), from our own verdicts and those that travel in the
    accepted sets; ``by_guard``: sender -> banned until round, from rounds every peer's guard refused alike (such a
    peer no longer coordinates while banned, unlike one a coordinator's word alone banned); ``missed``: the senders
    whose latest ban is for contributions they did not deliver (no evidence that anything they sent was false)."""

    def __init__(self) -> None:
        self.until: dict[str, tuple[int, int]] = {}
        self.by_guard: dict[str, int] = {}
        self.missed: set[str] = set()
        self.misses: dict[str, list[int]] = {}  # sender -> recent rounds whose announced payload could not be had

    def __contains__(self, sender: object) -> bool:
        return sender in self.until

    def __iter__(self) -> Iterator[str]:
        return iter(self.until)

    def ban(self, r: int, sender: str, reason: str, missed: bool = False) -> None:
        """Reject a sender's contribution and ban it for 2, 4, 8, ... rounds; the ban travels in the accepted set,
        marked when it is for undelivered contributions (``missed``) rather than for something false."""
        strikes = self.until.get(sender, (0, 0))[1] + 1
        self.until[sender] = (ban_end(r, strikes), strikes)
        if missed:
            self.missed.add(sender)
        else:
            self.missed.discard(sender)
        logger.warning("round %d: rejected the contribution of %s (%s); banned until round %d", r, sender[:16],
                       reason, self.until[sender][0])

    def miss(self, r: int, sender: str) -> None:
        """A sender whose announced contribution of round r could not be fetched: a second miss within
        ``MISS_WINDOW`` rounds bans it like garbage (a notice costs its sender a signature, its receivers a fetch
        timeout). At most ``MAX_MISSERS`` senders are remembered, the oldest forgotten first."""
        recent = [x for x in self.misses.pop(sender, []) if x > r - MISS_WINDOW] + [r]
        self.misses[sender] = recent
        while len(self.misses) > MAX_MISSERS:
            self.misses.pop(next(iter(self.misses)))
        if len(recent) >= 2:
            self.ban(r, sender, f"{len(recent)} announced contributions in {MISS_WINDOW} rounds could not be fetched",
                     missed=True)

    def ban_by_guard(self, r: int, sender: str, reason: str) -> None:
        """Ban a sender whose contribution made the round guard refuse the round (the same verdict everywhere)."""
        self.ban(r, sender, reason)
        self.by_guard[sender] = self.until[sender][0]

    def pardon(self, sender: str) -> None:
        """Lift the last ban of ``sender``, made on evidence this peer no longer trusts (its own state was not the
        others'): it is no longer banned, and that strike no longer counts."""
        until, strikes = self.until.pop(sender, (0, 0))
        self.by_guard.pop(sender, None)
        self.missed.discard(sender)
        if strikes > 1:
            self.until[sender] = (0, strikes - 1)
        if until:
            logger.warning("lifted the ban of %s: it was judged from a state the others did not hold", sender[:16])

    def banned(self, sender: str, r: int) -> bool:
        return sender in self.until and r < self.until[sender][0]

    def refused_by_all(self, peer: str, r: int) -> bool:
        """Whether ``peer`` sent what made every peer's guard refuse a round: it no longer coordinates while
        banned."""
        return peer in self.by_guard and r < self.by_guard[peer]

    def travelling(self, r: int) -> tuple[tuple[str, int], ...]:
        """The bans still in force after round r, as an accepted set carries them."""
        return tuple(sorted((p, u) for p, (u, _) in self.until.items() if u > r))

    def travelling_missed(self, r: int) -> tuple[str, ...]:
        """Those of :meth:`travelling`'s bans that are for undelivered contributions, as an accepted set marks them."""
        return tuple(sorted(p for p in self.missed if self.until.get(p, (0, 0))[0] > r))

    def to_json(self) -> dict[str, Any]:
        """The bans and strike counts, as a checkpoint header keeps them (the ``MAX_SAVED_BANS`` that end last)."""
        kept = dict(sorted(self.until.items(), key=lambda item: item[1][0], reverse=True)[:MAX_SAVED_BANS])
        return {"until": {p: [u, n] for p, (u, n) in kept.items()},
                "by_guard": {p: u for p, u in self.by_guard.items() if p in kept},
                "missed": sorted(p for p in self.missed if p in kept)}

    def load_json(self, raw: Any) -> bool:
        """Take a checkpoint header's bans in place of these; returns whether the record was well-formed. The file
        is as hostile as the network: a malformed record is ignored whole, and only short peer ids, small ints and
        a bounded count are taken. Misses are not kept: a restart starts counting them again."""
        def ok_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40

        def ok_peer(p: Any) -> bool:
            return isinstance(p, str) and 0 < len(p) <= 128

        if not isinstance(raw, dict) or not isinstance(raw.get("until"), dict) or \
                not isinstance(raw.get("by_guard"), dict):
            return False
        until, by_guard = raw["until"], raw["by_guard"]
        if len(until) > MAX_SAVED_BANS or len(by_guard) > MAX_SAVED_BANS:
            return False
        if not all(ok_peer(p) and isinstance(v, list) and len(v) == 2 and all(ok_int(x) for x in v)
                   for p, v in until.items()):
            return False
        if not all(ok_peer(p) and ok_int(u) and p in until for p, u in by_guard.items()):
            return False
        missed = raw.get("missed", [])  # absent in older checkpoints
        if not isinstance(missed, list) or not all(isinstance(p, str) and p in until for p in missed):
            return False
        self.until = {p: (u, n) for p, (u, n) in until.items()}
        self.by_guard = dict(by_guard)
        self.missed = set(missed)
        return True
