"""A replica's part in its rounds' committees (:mod:`hlbp.peer.rounds.committee`): whom its notice goes to, what it
forwards to the leads while it holds a part, what it relays once a round closes, and whose checksums it reads.

:class:`Seating` keeps the members of the last rounds (a committee reaches back ``LOOKBACK`` rounds; a peer that
did not close them learns them from their records) and what it already passed on; the :class:`~hlbp.peer.rounds.closer.Closer` calls it from its close loop with the round's
records as read. The signed bytes it passes on come from ``signed(r, kind, signer, same)``: the record as we hold it
(pushed, forwarded or read; an accepted set equal to ``same``), or None.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from hlbp.peer.rounds.committee import (
    LOOKBACK,
    CommitteeRule,
    check_sample,
    committee,
    forwarded,
    gone,
    holders,
    leads,
    notice_to,
    part_complete,
    part_of,
    parts_in,
    relayed_to,
)
from hlbp.peer.rounds.gather import GatherRule
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import round_set
from hlbp.protocol.roundwire import KIND_ACCEPTED, KIND_CONTRIB, AcceptedSet, ContribNotice

Signed = Callable[[int, str, str, AcceptedSet | None], bytes | None]


class Seating:
    """This peer's committee duties, round by round (see the module docstring)."""

    def __init__(self, me: str, rule: CommitteeRule, gather: GatherRule, records: RoundRecords,
                 signed: Signed) -> None:
        self.me, self.rule, self.gather, self.records, self.signed = me, rule, gather, records, signed
        self.recent: dict[int, frozenset[str]] = {}  # round -> the members of the set we took (or learnt)
        self.sent: dict[int, set[str]] = {}  # round -> the notices we forwarded to its leads
        self.told_complete: set[int] = set()  # rounds whose leads we told our part is complete
        self.relayed: set[int] = set()  # rounds whose accepted set we relayed
        self.answered: dict[int, float] = {}  # round -> when we last forwarded to its leads (monotonic)
        self.calls: dict[int, float] = {}  # round -> when we (a lead) asked its holders for their parts
        self._seats: tuple[int, dict[int, frozenset[str]], tuple[str, ...]] | None = None
        self.learnt = -1  # the last round whose committee we learnt from the records (learn)

    def note(self, r: int, members: AbstractSet[str]) -> None:
        """Round r closed with ``members``: they take seats in the next rounds' committees."""
        self.recent = {k: v for k, v in self.recent.items() if k > r - LOOKBACK - 1} | {r: frozenset(members)}
        self.sent = {k: v for k, v in self.sent.items() if k > r - 3}
        self.told_complete = {k for k in self.told_complete if k > r - 3}
        self.relayed = {k for k in self.relayed if k > r - 3}
        self.answered = {k: v for k, v in self.answered.items() if k > r - 3}
        self.calls = {k: v for k, v in self.calls.items() if k > r - 3}

    def recorded_set(self, r: int, notices: Mapping[str, ContribNotice], sets: Sequence[AcceptedSet],
                     n_shards: int) -> AcceptedSet | None:
        """Round r's accepted set as its records in the DHT show it (:func:`~hlbp.peer.rounds.rules.round_set`),
        its committee's leads first when we know them."""
        undialable = {p for p, n in notices.items() if not n.dialable}
        return round_set(r, {p: set(n.digests) for p, n in notices.items()}, sets, n_shards, undialable,
                         leads(self.seats(r), self.rule))

    def learn(self, r: int, read: Callable[[int], tuple[dict[str, ContribNotice], list[AcceptedSet]]],
              n_shards: int) -> None:
        """The members of the rounds round r's committee is drawn from (r - 2 and before), from their records
        (``read(k)``: round k's notices and accepted sets, from the DHT), for a peer that did not close them (a
        joiner, a resynced or restarted peer). Without them it knew no committee for two rounds: it pushed its
        notice to every peer, read every notice and ranked the coordinators without the leads, so it could take,
        or publish, a set the others did not (measured: a cascade of resyncs after a holder died). Rounds are read
        newest first until their members fill the seats, then picked oldest first, so that each round's leads are
        known when its set is picked. Once per round."""
        if not self.rule.on or r < 2 or self.knows(r - 2) or self.learnt == r:
            return
        self.learnt = r
        found: list[tuple[int, tuple[dict[str, ContribNotice], list[AcceptedSet]]]] = []
        heard: set[str] = set()
        filled: int | None = None  # how many rounds read when their sets' senders filled the seats
        for k in range(r - 2, max(-1, r - 2 - LOOKBACK), -1):
            if self.knows(k) or (filled is not None and len(found) >= filled + 2):
                break  # two rounds past the seats: the leads of the rounds that give them are known too
            records = read(k)
            if not records[1]:
                break  # an empty round, or its records expired: the committee reaches no further back
            found.append((k, records))
            heard.update(p for s in records[1] for p in s.senders())
            if filled is None and len(heard) >= self.rule.size:
                filled = len(found)
        for k, (notices, sets) in reversed(found):
            chosen = self.recorded_set(k, notices, sets, n_shards)
            if chosen is not None and chosen.members:
                self.note(k, set(chosen.senders()))

    def knows(self, r: int) -> bool:
        """Whether we hold round r's members (we closed it, or learnt it from its records)."""
        return r in self.recent

    def forget(self) -> None:
        """We resynced: the sets we took may not be the run's, so we know no committee until we take new ones."""
        self.recent = {}

    def seats(self, r: int) -> tuple[str, ...]:
        """Round r's committee: round r - 2's members in rendezvous order, then those of the rounds before it. Two
        rounds back, because a round's notices go out before the round before it closes everywhere (an overlapped
        exchange runs during the next inner phase): round r - 2 has closed for every in-sync peer by then. Empty:
        no committee (the rule is off, or we do not know round r - 2's members: we joined or resynced lately)."""
        recent = self.recent  # replaced whole by note and forget, never changed in place: a cache key
        cached = self._seats
        if cached is not None and cached[0] == r and cached[1] is recent:
            return cached[2]
        seats = committee(r, [recent.get(k, frozenset()) for k in range(r - 2, r - 2 - LOOKBACK, -1)], self.rule)
        self._seats = (r, recent, seats)  # asked at every poll of a round's close
        return seats

    def notice_targets(self, r: int, seats: Sequence[str], online: AbstractSet[str] | None) -> set[str]:
        """Where our notice of round r goes: its holder, and the leads as well when the holder is gone from
        ``online`` (the announced contributors as last read; None: not known)."""
        return notice_to(r, self.me, seats, self.rule, online)

    def holders(self, seats: Sequence[str]) -> tuple[str, ...]:
        """The seats that hold parts of the notices."""
        return holders(seats, self.rule)

    def gone(self, seats: Sequence[str], online: AbstractSet[str] | None) -> frozenset[str]:
        """The holders no longer announced online (:func:`~hlbp.peer.rounds.committee.gone`): a lead waits for
        no part of theirs."""
        return gone(seats, self.rule, online)

    def part(self, r: int, seats: Sequence[str], senders: AbstractSet[str]) -> set[str]:
        """Of ``senders``, those whose notices we hold in round r."""
        return part_of(r, self.me, seats, self.rule, senders)

    def part_complete(self, r: int, seats: Sequence[str], senders: AbstractSet[str],
                      expected: AbstractSet[str] | None) -> bool:
        """Whether every expected contributor (None: not known) whose holder we are has sent us its notice."""
        return part_complete(r, self.me, seats, self.rule, senders, expected)

    def parts_complete(self, r: int, seats: Sequence[str], told: AbstractSet[str], senders: AbstractSet[str],
                       expected: AbstractSet[str] | None, away: AbstractSet[str] = frozenset()) -> bool:
        """Whether we (a lead) have every part of round r's notices (:func:`~hlbp.peer.rounds.committee.parts_in`:
        ``told``, who said its part is complete, taken before the notices were read so that their forwards are
        among them; ``away``, the holders gone from the announcements, whose parts reach us directly)."""
        return parts_in(r, self.me, seats, self.rule, told, senders, expected, away)

    def forward(self, r: int, seats: Sequence[str], part: Mapping[str, AbstractSet[int]], veterans: Mapping[str, int],
                complete: bool, force: bool = False) -> None:
        """As a holder of round r, pass on to the leads the notices of our ``part`` the gather rule could select
        (once each), and whether the part is complete. Called when the part is complete, our window passed, or a
        lead asked (``force``: answer even with nothing new, so it need not wait)."""
        if self.me not in self.holders(seats):
            return
        sent = self.sent.get(r)
        new = [p for p in forwarded(r, part, veterans, self.gather) if sent is None or p not in sent]
        if sent is not None and not new and not force and not (complete and r not in self.told_complete):
            return
        records = []
        for p in new:
            value = self.signed(r, KIND_CONTRIB, p, None)
            if value is not None:
                records.append((KIND_CONTRIB, p, value))
        self.sent[r] = (sent or set()) | set(new)
        self.answered[r] = time.monotonic()
        if complete:
            self.told_complete.add(r)
        self.records.pass_on(set(leads(seats, self.rule)), r, records, complete)

    def called(self, r: int, seats: Sequence[str]) -> bool:
        """Whether a lead of round r asked us (a holder) for our part since we last forwarded it: a bundle from a
        lead, before any accepted set."""
        if self.me not in self.holders(seats) or self.me in leads(seats, self.rule):
            return False
        since = self.answered.get(r, -1.0)
        return any(self.records.bundles_from(r).get(lead, -1.0) > since for lead in leads(seats, self.rule))

    def forwards_in(self, r: int, seats: Sequence[str], bundled: Mapping[str, float], now: float,
                    grace_s: float, away: AbstractSet[str] = frozenset()) -> bool:
        """As a lead whose turn to close round r came before every part was complete: whether the holders'
        forwards are in (``bundled``: who passed records on to us and when, taken before the notices were read).
        The first time, ask every holder not ``away`` for its part (an empty bundle); then wait until each
        answered, or ``grace_s`` passed (a holder that left without its announcement expiring never answers)."""
        holders = set(self.holders(seats)) - {self.me} - set(away)
        if r not in self.calls:
            self.calls[r] = now
            self.records.pass_on(holders, r, [], False)
            return not holders
        heard = {h for h, t in bundled.items() if t >= self.calls[r]}
        return holders <= heard or now >= self.calls[r] + grace_s

    def publish(self, r: int, seats: Sequence[str], accepted: AcceptedSet, value: bytes) -> None:
        """As round r's coordinator, send the accepted set (signed ``value``) with its members' notices, and ours,
        to the committee."""
        self.records.pass_on(set(seats), r, self.with_notices(r, accepted, value), True)

    def relay(self, r: int, seats: Sequence[str], accepted: AcceptedSet, senders: AbstractSet[str]) -> None:
        """As a seat that took round r's accepted set, relay it, with its members' notices, to the senders of the
        notices we hold (once)."""
        if self.me not in seats or r in self.relayed:
            return
        value = self.signed(r, KIND_ACCEPTED, accepted.coordinator, accepted)
        targets = relayed_to(r, self.me, seats, set(senders), self.rule)
        if value is None or not targets:
            return
        self.relayed.add(r)
        self.records.pass_on(targets, r, self.with_notices(r, accepted, value), True)

    def with_notices(self, r: int, accepted: AcceptedSet, value: bytes) -> list[tuple[str, str, bytes]]:
        """The accepted set's signed bytes, its coordinator's notice and its members' notices (those we hold)."""
        records = [(KIND_ACCEPTED, accepted.coordinator, value)]
        for p in dict.fromkeys([accepted.coordinator, *accepted.senders()]):
            notice = self.signed(r, KIND_CONTRIB, p, None)
            if notice is not None:
                records.append((KIND_CONTRIB, p, notice))
        return records

    def check_peers(self, r: int) -> list[str]:
        """Whose checksum records of round r we read: a sample of round r + 1's committee (members of recent
        rounds, which applied round r)."""
        return check_sample(r, self.me, self.seats(r + 1), self.rule)
