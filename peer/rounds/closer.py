"""Closing a SparseLoCo round: who coordinates, when the accepted set is published, what it admits, and the bans
that travel with it.

The contributors of round r are ranked by rendezvous hashing of (round, peer id). The first-ranked one publishes
the signed accepted set when every expected contributor has arrived or the adaptive window after the first arrival
has passed; the k-th ranked one takes over after k further ``takeover_s`` if nothing appeared. Everybody applies
the set of the best-ranked coordinator that published one. A straggler is never waited for. The decisions
(ranking, windows, which set wins) are pure functions in :mod:`hlbp.peer.rounds.rules`; :class:`Closer` runs them
over the round's records and payloads; :class:`~hlbp.peer.rounds.bans.RoundBans` keeps whom the round loop
refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hlbp.peer.rounds.admission import Admission, Screen
from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.committee import CommitteeRule, leads
from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.gather import GatherRule, Standing
from hlbp.peer.rounds.inbox import Both, DhtPoll
from hlbp.peer.rounds.payloads import Payloads
from hlbp.peer.rounds.records import RoundRecords
from hlbp.peer.rounds.rules import (
    UNKNOWN,
    Expected,
    Verdict,
    adapt_window,
    close_verdict,
    complete,
    dropped_named,
    holds_up,
    pick_accepted,
    set_counts,
    turn_order,
    widen_for_late,
)
from hlbp.peer.rounds.seating import Seating
from hlbp.peer.rounds.selection import Selection
from hlbp.peer.rounds.state import LearnedWindow
from hlbp.protocol import ProtocolError
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_CONTRIB,
    MAX_MEMBERS,
    AcceptedSet,
    ContribNotice,
    parse_accepted,
    parse_contrib,
    round_key,
)

logger = logging.getLogger(__name__)

ONLINE_EVERY = 4  # rounds between a peer's reads of the announcements when it holds no seat (N entries each)

def signed_form(value: Any, check: Callable[[bytes], Any]) -> bytes | None:
    """Of a DHT entry's value (bytes, or a stored and a pushed one), the signed bytes ``check`` accepts."""
    forms = [value.stored, value.pushed] if isinstance(value, Both) else [value]
    for form in forms:
        if isinstance(form, bytes):
            try:
                if check(form):
                    return form
            except ProtocolError:
                continue
    return None


class Closer:
    """Closes the rounds of one round loop (see the module docstring).

    ``expected()``: the contributors to wait for before closing early (:class:`~hlbp.peer.rounds.rules.Expected`;
    a count of 0: unknown, wait out the window).
    ``choose(r, admitted, notices)``: the contributions to publish as accepted when we coordinate (production:
    ``admitted`` as it is). ``on_poll(r)``: called at every poll while the round is open. ``standing``: the
    record of who was selected when (the replica state's; a fresh one when None). ``learned``: the window learned so
    far (the replica state's, which checkpoints keep; a fresh one when None).
    """

    def __init__(self, me: str, cfg: RoundConfig, n_shards: int, records: RoundRecords, payloads: Payloads,
                 bans: RoundBans, expected: Callable[[], Expected], stop: Any,
                 choose: Callable[[int, dict[str, Any], dict[str, Any]], dict[str, Any]] = lambda r, a, n: a,
                 on_poll: Callable[[int], None] = lambda r: None, standing: Standing | None = None,
                 screen: Screen | None = None, learned: LearnedWindow | None = None) -> None:
        self.me, self.cfg, self.n_shards = me, cfg, n_shards
        self.records, self.payloads, self.bans = records, payloads, bans
        self.expected, self.stop, self.choose, self.on_poll = expected, stop, choose, on_poll
        self.learned = learned if learned is not None else LearnedWindow()  # the window, also kept in checkpoints
        self.close_window = self.window  # the window of the round close last waited for
        # the last closed round as we saw it close: (round, its first arrival, its window, the accepted senders),
        # for widen_for_late
        self.last_close: tuple[int, float, float, frozenset[str]] | None = None
        # the members of the last round we closed (round, peer -> the shards it contributed): the next round's turn
        # order starts with them (rules.turn_order)
        self.prior: tuple[int, dict[str, frozenset[int]]] | None = None
        self.prior_undialable: frozenset[str] = frozenset()  # the members of that round whose notices said NATed
        self.raw: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # round -> its last-read entries
        self.proofs: dict[int, dict[str, dict[str, bytes]]] = {}  # round -> the evidence of its members
        self.prior_read = -1  # the last round whose members were read from its records (learn_prior)
        self.first_seen: dict[int, float] = {}  # round -> when we first saw one of its notices (time.monotonic)
        # round -> when we first saw a notice of it from another member of the round before (a key that was no
        # member cannot move it: rules.holds_up)
        self.member_seen: dict[int, float] = {}
        self.announced = UNKNOWN  # the expected contributors as last read (each close reads them anew)
        self._phase_expected: tuple[int, Expected] = (-1, UNKNOWN)  # read once a round by round_closed
        # the run's cap on a round's contributions, and who was selected when as the sets we took show (the replica
        # state holds the standing, and its checkpoints)
        rule = GatherRule(cfg.gather, cfg.reserves)
        self.selection = Selection(n_shards, rule, cfg.allowed_peers, bans, CommitteeRule(cfg.committee), standing)
        # fetching and checking contributions (and, given a screen, auditing their senders' pipeline traffic)
        self.admission = Admission(me, cfg, n_shards, payloads, bans, screen)
        # our seats in the rounds' committees, when the run has one (committee.py, seating.py)
        self.seating = Seating(me, CommitteeRule(cfg.committee), rule, records, self.signed)
        # (round, the peers announced online as read then -> the shards each applies): whom each shard's payload
        # fetch trees span (spread.py); a seat reads the announcements every round, any other peer every ONLINE_EVERY
        self.online: tuple[int, dict[str, frozenset[int]]] = (-ONLINE_EVERY, {})

    @property
    def window(self) -> float:
        """The adaptive collection window after a round's first arrival: the one learned, within the manifest's
        bounds, or the manifest's first window before any is."""
        if self.learned.seconds is None:
            return self.cfg.deadline_s
        return min(max(self.learned.seconds, self.cfg.min_deadline_s), self.cfg.max_deadline_s)

    @window.setter
    def window(self, seconds: float) -> None:
        self.learned.seconds = seconds

    def seats(self, r: int) -> tuple[str, ...]:
        """Round r's committee as we know it (empty: the run has none, or round r - 2's members are not known and
        cannot be learnt from its records)."""
        self.seating.learn(r, lambda k: self.round_records(k, full=True), self.n_shards)
        return self.seating.seats(r)

    def notice_targets(self, r: int) -> set[str] | None:
        """Whom our notice of round r is pushed to: its holder in the committee, and the leads as well when the
        announcements we last read no longer name that holder; None: every live peer."""
        seats = self.seats(r)
        return self.seating.notice_targets(r, seats, set(self.online[1]) or None) if seats else None

    def check_peers(self, r: int) -> list[str] | None:
        """Whose checksum records of round r we read: a sample of round r + 1's committee; None: the members'."""
        sample = self.seating.check_peers(r)
        return sample if sample else None

    def signed(self, r: int, kind: str, signer: str, same: AcceptedSet | None = None) -> bytes | None:
        """``signer``'s record of ``kind`` in round r as we hold it (read or pushed), checked (an accepted set:
        equal to ``same`` when given); None if we lack it."""
        run = self.cfg.run_id
        contribs, sets = self.raw.get(r, ({}, {}))
        value = (contribs if kind == KIND_CONTRIB else sets).get(signer)
        if value is None:
            value = self.records.inbox.entries(round_key(run, r, kind)).get(signer)
        if value is None:
            return None
        if kind == KIND_CONTRIB:
            return signed_form(value, lambda v: parse_contrib(v, signer, run, round_=r) is not None)
        return signed_form(value, lambda v: (same is None or parse_accepted(v, signer, run, round_=r) == same))

    def prior_members(self, r: int) -> frozenset[str]:
        """The members of round r - 1 as we closed it (empty when we did not)."""
        return frozenset(self.prior[1]) if self.prior is not None and self.prior[0] == r - 1 else frozenset()

    def round_closed(self, r: int, wait: bool = True) -> bool:
        """Whether round r has an accepted set that counts by now (``wait``: read now; else as the phase's poller
        last read).

        A set of the first in turn counts at once when every expected contributor announced (rules.set_counts);
        the expected contributors are read (once a round, by a check that may wait) only when a set is there and
        would not count without them. Without them a peer with no order agreed before the round (round 0, the round after a sync) took a set
        only a whole window after its first notice: an idle standby then stayed in round 0's phase until the round's
        payloads were gone, and had to sync instead of taking part."""
        notices, sets = self.round_records(r, wait, self.records.phase_poller)
        if not sets:
            return False
        if self.accepted(r, sets, notices) is not None:
            return True
        if self._phase_expected[0] != r:
            if not wait:
                return False  # a look-up that must not wait reads nothing: the next waiting check will
            self._phase_expected = (r, self.expected())
        return self.accepted(r, sets, notices, self._phase_expected[1]) is not None

    def round_started(self, r: int, wait: bool = True) -> bool:
        """Whether others already announced round r (or it closed)."""
        notices, sets = self.round_records(r, wait, self.records.phase_poller)
        return bool(sets) or any(sender != self.me and not self.bans.banned(sender, r) for sender in notices)

    def holding_up(self, r: int) -> bool:
        """Whether our inner phase of round r holds the round up (:func:`hlbp.peer.rounds.rules.holds_up`): we
        come first in its turn order agreed before it and another member of round r - 1 announced it half a window
        ago (notices under other keys do not count: a flood of them cannot cut an honest head's phase short).
        Answered from what the phase's poller last read, never waiting (the phase asks between its steps)."""
        prior = self.prior
        if prior is None or prior[0] != r - 1 or self.me not in prior[1]:
            return False
        members = {p: s for p, s in prior[1].items() if not self.bans.refused_by_all(p, r)}
        return holds_up(self.me, r, members, self.n_shards, self.prior_undialable,
                        leads(self.seating.seats(r), self.seating.rule), self.member_seen.get(r), time.monotonic(),
                        self.window)

    def round_records(self, r: int, wait: bool = True, poller: DhtPoll | None = None,
                      full: bool = False) -> tuple[dict[str, ContribNotice], list[AcceptedSet]]:
        """Round r's contribution notices (by sender) and published accepted sets, read in one concurrent poll
        (``wait``), or as ``poller`` (default: the exchange's) last polled plus what was pushed since. A round with
        a committee reads only its accepted sets from the DHT (a few records) and takes the notices pushed or
        passed on to us, unless ``full`` (every notice: N records)."""
        keys = (round_key(self.cfg.run_id, r, KIND_CONTRIB), round_key(self.cfg.run_id, r, KIND_ACCEPTED))
        # a flood of notices under fresh keys that filled our inbox for the round: read them from the DHT as well
        if not full and self.seats(r) and not self.records.inbox.full(keys[0]):
            accepted = self.records.read(keys[1])[0] if wait else (poller or self.records.poller).entries(keys[1])[0]
            contribs = self.records.inbox.entries(keys[0])
        else:
            contribs, accepted = self.records.read(*keys) if wait else (poller or self.records.poller).entries(*keys)
        self.raw = {**{k: v for k, v in self.raw.items() if k >= r - 2}, r: (contribs, accepted)}
        notices = {n.sender: n for n in self.records.records(keys[0], parse_contrib, contribs, round_=r)}
        self.records.seen(r, notices)
        if notices and r not in self.first_seen:
            self.first_seen = {k: t for k, t in self.first_seen.items() if k >= r - 2}
            self.first_seen[r] = time.monotonic()
        prior = self.prior
        if r not in self.member_seen and prior is not None and prior[0] == r - 1 \
                and any(sender in prior[1] and sender != self.me for sender in notices):
            self.member_seen = {k: t for k, t in self.member_seen.items() if k >= r - 2}
            self.member_seen[r] = time.monotonic()
        return notices, self.records.records(keys[1], parse_accepted, accepted, round_=r)

    def turn(self, r: int, notices: dict[str, ContribNotice]) -> tuple[list[str], bool]:
        """Round r's turn order (:func:`hlbp.peer.rounds.rules.turn_order`) and whether its head was agreed before
        the round (we closed round r - 1 with members; a joiner, a resynced peer or the run's first round has no
        such order yet, and ranks the contributors it sees)."""
        if (self.prior is None or self.prior[0] != r - 1) and self.prior_read != r - 1 and r > 0:
            self.prior_read = r - 1  # once per round: a joiner or a resynced peer did not close round r - 1
            self.learn_prior(r - 1)
        prior = self.prior[1] if self.prior is not None and self.prior[0] == r - 1 else {}
        prior = {p: s for p, s in prior.items() if not self.bans.refused_by_all(p, r)}
        seen = {p: frozenset(n.digests) for p, n in notices.items() if not self.bans.refused_by_all(p, r)}
        # behind NAT as the notices said: last round's for its members (agreed before the round), this round's for
        # the others
        undialable = self.prior_undialable | {p for p, n in notices.items() if not n.dialable and p not in prior}
        order = turn_order(r, prior, seen, self.n_shards, undialable, self.announced.peers)
        lead = list(leads(self.seats(r), self.seating.rule))
        if lead:  # with a committee its leads coordinate first: they receive the holders' forwards
            return lead + [p for p in order if p not in lead], True
        return order, bool(prior)

    def learn_prior(self, r: int) -> None:
        """Round r's members from its records, for a peer that did not close round r itself (a joiner, a resynced
        or restarted peer): the set of the best-ranked contributor that published one (its committee's leads
        first). Without them its first round after the sync waited out a window before taking any set, and it
        missed the next round's close."""
        notices, sets = self.round_records(r, full=True)
        chosen = self.seating.recorded_set(r, notices, sets, self.n_shards)
        undialable = {p for p, n in notices.items() if not n.dialable}
        if chosen is not None and chosen.members:
            self.seating.note(r, set(chosen.senders()))
            self.prior = (r, {p: frozenset(d) for p, _t, d in chosen.members})
            self.prior_undialable = frozenset(p for p in self.prior[1] if p in undialable)

    def accepted(self, r: int, sets: list[AcceptedSet], notices: dict[str, ContribNotice],
                 expected: Expected = UNKNOWN) -> AcceptedSet | None:
        """The accepted set of round r that every peer applies: among the sets whose publisher's turn has come by
        now (:func:`hlbp.peer.rounds.rules.set_counts`; ``expected``: the contributors that make the round
        complete, :func:`hlbp.peer.rounds.rules.complete`), the best-ranked one. A set published out of turn is ignored until its turn comes, and by then
        the set of the coordinator in charge has normally replaced it."""
        order, prior_known = self.turn(r, notices)
        now = time.monotonic()
        whole = complete(notices, expected, lambda p: self.bans.banned(p, r))
        # only a contributor of the round closes it: its notice is what shows later readers (a restarted peer's
        # sync, rules.round_members) that its set was the round's
        counting = [x for x in sets if not self.bans.refused_by_all(x.coordinator, r) and x.coordinator in notices
                    and self.selection.keeps_rule(r, x, notices)
                    and set_counts(x, order, prior_known=prior_known, complete=whole,
                                   first_seen=self.first_seen.get(r), now=now, window=self.window,
                                   max_window=self.cfg.max_deadline_s, takeover_s=self.cfg.takeover_s,
                                   min_contributors=self.cfg.min_contributors)]
        return pick_accepted(counting, order)

    def close(self, r: int) -> AcceptedSet | None:
        """Wait for round r's accepted set, publishing it ourselves when we are the coordinator in charge."""
        first_seen: float | None = None
        held: float | None = None  # when a set counted while a member's notice was still unread here
        arrivals: dict[str, float] = {}
        give_up = time.monotonic() + self.cfg.longest_open_s()
        seats = self.seats(r)
        # a count of 0 means the announcements could not be read: wait out the window rather than close on the first
        # (with a committee only its seats need them)
        expected = self.announced = self.expected() if not seats or self.me in seats else UNKNOWN
        if expected.count:
            self.online = (r, dict(expected.shards or {}))
        elif r >= self.online[0] + ONLINE_EVERY:  # a peer off the committee reads them now and then
            read = self.expected()
            self.online = (r, dict(read.shards or {})) if read.count else self.online
        # the holders whose announcements expired (killed mid-run): their parts are not waited for
        away = self.seating.gone(seats, expected.peers if expected.count else None) if seats else frozenset()
        self.widen_for_late()
        self.close_window = self.window
        read_all: dict[str, ContribNotice] | None = None  # with a committee: every notice, read once when needed
        sets_since: float | None = None
        published = False
        while not self.stop.is_set():
            now = time.monotonic()
            # what holders passed on, taken before the notices are read: a forward that lands between the two
            # must not count as in while its notices are not
            told, bundled = self.records.complete_parts(r), self.records.bundles_from(r)
            notices, sets = self.round_records(r, wait=False)
            if seats:
                notices = {**(read_all or {}), **notices}
                self.hold_part(r, seats, notices, expected, now)
                sets_since = sets_since or (now if sets else None)
                if read_all is None and sets_since is not None and now >= sets_since + self.cfg.grace_s \
                        and any(s.coordinator not in notices for s in sets):
                    # a set whose coordinator's notice never reached us (our holder left): read the notices once
                    read_all = self.round_records(r, full=True)[0]
                    continue
            if not seats or self.me in leads(seats, self.seating.rule):
                # a seat's view holds its part only, and the others see no notices: what they would guess the gather
                # rule selects is mostly wrong, so they fetch after the accepted set instead
                self.payloads.prefetch(r, self.selection.likely(r, notices))
            self.on_poll(r)  # e.g. an overlapped phase takes in the round's result as far as it is fetched
            for sender in notices:
                arrivals.setdefault(sender, now)
            order, _ = self.turn(r, notices)
            accepted = self.accepted(r, sets, notices, expected)
            if accepted is not None and any(p not in notices for p in accepted.senders()) \
                    and now < (held := held or now) + self.cfg.grace_s:
                # the next round's turn order ranks the members behind NAT last, as their own notices say: a peer
                # that took the set before reading every member's notice ranked a NATed one first, and waited out a
                # window and a takeover for the coordinator the others took at once. The notices come soon (each
                # member published one before the coordinator saw it); a set naming a notice that never comes is
                # taken after ``grace_s``.
                self.records.inbox.wait(self.cfg.poll_s)
                continue
            if accepted is not None:
                self.selection.took(r, accepted)
                self.seating.note(r, set(accepted.senders()))
                if seats:
                    self.seating.relay(r, seats, accepted, set(notices))
                self.proofs = {**{k: v for k, v in self.proofs.items() if k >= r - 3}, r: self.evidence(r, accepted)}
                self.admission.check_bans(r, accepted, notices, self.window)
                if accepted.members:
                    self.prior = (r, {p: frozenset(d) for p, _t, d in accepted.members})
                    self.prior_undialable = frozenset(p for p in self.prior[1]
                                                      if p in notices and not notices[p].dialable)
                on_time = [arrivals[s] for s in accepted.senders() if s in arrivals]
                if on_time:
                    self.last_close = (r, min(on_time), self.window, frozenset(accepted.senders()))
                    self.window = adapt_window([t - min(on_time) for t in on_time], self.cfg.min_deadline_s,
                                               self.cfg.max_deadline_s, self.window)
                return accepted
            if notices:
                first_seen = first_seen if first_seen is not None else now
                if self.me in order and self.me in notices:
                    rank = order.index(self.me)
                    if self.selection.late_turn(r):
                        rank += len(order)
                    due = first_seen + self.window + rank * self.cfg.takeover_s
                    whole = complete(notices, expected, lambda p: self.bans.banned(p, r)) or bool(seats) and \
                        self.seating.parts_complete(r, seats, told, set(notices),
                                                    expected.peers if expected.count else None, away)
                    if seats and read_all is None and self.me not in leads(seats, self.seating.rule) and now >= due:
                        # the leads' turns passed without a set: we coordinate from every notice, read once
                        read_all = self.round_records(r, full=True)[0]
                        continue
                    if ((rank == 0 and whole) or now >= due) and not published \
                            and (whole or not seats or read_all is not None
                                 or self.seating.forwards_in(r, seats, bundled, now, self.cfg.grace_s, away)):
                        admitted = self.choose(r, self.selection.choose(r, notices, self._admit(r)), notices)
                        verdict = close_verdict(len(admitted), self.cfg.min_contributors, now, first_seen,
                                                self.cfg.max_deadline_s, rank, self.cfg.takeover_s)
                        if verdict is not Verdict.WAIT:
                            if verdict is Verdict.EMPTY:
                                logger.warning("round %d: %d of the %d contributions the run requires arrived within "
                                               "%.0f s; closing it empty (nobody's parameters move)", r,
                                               len(admitted), self.cfg.min_contributors, self.cfg.max_deadline_s)
                                admitted = {}
                            self.publish(r, admitted, seats, set(notices))
                            published = True  # once: a coordinator that published two sets would split the run
                            continue
            if now > give_up:
                logger.warning("round %d: nobody closed the round within %.0f s; moving on", r,
                               give_up - (first_seen or give_up))
                return None
            self.records.inbox.wait(self.cfg.poll_s)  # wakes at once for a pushed record or a finished DHT read
        return None

    def publish(self, r: int, admitted: dict[str, ContribNotice], seats: tuple[str, ...], to: set[str]) -> None:
        """Publish round r's accepted set of ``admitted``: stored in the DHT and pushed to ``to`` (the senders we
        saw) and the live peers; with a committee, passed to its seats with the members' notices instead, and the
        seats relay it on."""
        members = tuple((s, n.tokens, n.digests) for s, n in sorted(admitted.items()))
        dropped = dropped_named(self.admission.dropped(r), set(admitted), MAX_MEMBERS)
        chosen = AcceptedSet(self.me, r, members, self.bans.travelling(r), self.bans.travelling_missed(r), dropped)
        key, body = round_key(self.cfg.run_id, r, KIND_ACCEPTED), chosen.to_body(self.cfg.run_id)
        if seats:
            self.seating.publish(r, seats, chosen, self.records.store(key, body, KIND_ACCEPTED, only=frozenset()))
        else:
            self.records.store(key, body, KIND_ACCEPTED, to)

    def hold_part(self, r: int, seats: tuple[str, ...], notices: dict[str, ContribNotice], expected: Expected,
                  now: float) -> None:
        """As a holder in round r's committee: once our part of the notices is complete, or our window after its
        first one passed, forward what the gather rule could select to the leads (:class:`Seating`)."""
        if self.me not in self.seating.holders(seats):
            return
        mine = self.seating.part(r, seats, set(notices))
        whole = self.seating.part_complete(r, seats, set(notices), expected.peers if expected.count else None)
        called = self.seating.called(r, seats)  # a lead's window passed: it asked for what we hold now
        if whole or called or (r in self.first_seen and now >= self.first_seen[r] + self.window):
            part = self.selection.contenders(r, {p: notices[p] for p in mine})
            self.seating.forward(r, seats, part, self.selection.veterans(r), whole, force=called)

    def _admit(self, r: int) -> Callable[[dict[str, ContribNotice]], dict[str, ContribNotice]]:
        """Round r's admission of the given notices (:class:`~hlbp.peer.rounds.admission.Admission`), for the gather
        rule's selection to run."""
        return lambda notices: self.admission.admit(r, notices, self.window, self.prior_members(r))

    def evidence(self, r: int, accepted: AcceptedSet) -> dict[str, dict[str, bytes]]:
        """The signed records that show round r's members: ``accepted`` as its coordinator signed it and that
        coordinator's notice, as last read (:attr:`hlbp.peer.rounds.state.ReplicaState.evidence`); empty when
        either is no longer at hand."""
        keys = (round_key(self.cfg.run_id, r, KIND_CONTRIB), round_key(self.cfg.run_id, r, KIND_ACCEPTED))
        notice = self.signed(r, KIND_CONTRIB, accepted.coordinator)
        body = self.signed(r, KIND_ACCEPTED, accepted.coordinator, accepted)
        if notice is None or body is None:
            return {}
        return {keys[0]: {accepted.coordinator: notice}, keys[1]: {accepted.coordinator: body}}

    def widen_for_late(self) -> None:
        """Let the next window take back a peer that missed the last close by a little (:func:`hlbp.peer.rounds.rules.widen_for_late`).

        Its notice still lands after the close, pushed to us (the inbox notes when), and it is parsed and checked
        like any other. The adaptive window only sees on-time arrivals, so without this a peer landing just after
        each close (a restarted one catching up on a busy machine) was left out round after round. A notice that
        reaches us only through the DHT poll gives no time and widens nothing.
        """
        if self.last_close is None:
            return
        r, first, window, accepted = self.last_close
        self.last_close = None
        key = round_key(self.cfg.run_id, r, KIND_CONTRIB)
        landed = self.records.inbox.arrived(key)
        late = {s: b for s, b in self.records.inbox.entries(key).items()
                if s in landed and s not in accepted and s != self.me and not self.bans.banned(s, r)
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
