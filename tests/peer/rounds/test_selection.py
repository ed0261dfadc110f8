"""This peer's side of the gather rule (hlbp.peer.rounds.selection): what a coordinator selects around its
admission, which published sets keep the rule, and the ban of a coordinator that breaks it."""

from __future__ import annotations

from hlbp.peer.rounds.bans import RoundBans
from hlbp.peer.rounds.committee import CommitteeRule
from hlbp.peer.rounds.gather import GatherRule
from hlbp.peer.rounds.selection import Selection
from hlbp.protocol.roundwire import AcceptedSet, ContribNotice

PEERS = [f"peer{i:02d}" for i in range(8)]


def _notices(r: int, peers: list[str]) -> dict[str, ContribNotice]:
    return {p: ContribNotice(p, r, 100, {0: "ab" * 32}, {0: 10}) for p in peers}


def _accepted(r: int, coordinator: str, members: list[str]) -> AcceptedSet:
    return AcceptedSet(coordinator, r, tuple((p, 100, {0: "ab" * 32}) for p in sorted(members)))


def test_uncapped_it_takes_whatever_admission_passes() -> None:
    sel = Selection(1, GatherRule(), (), RoundBans(), CommitteeRule())
    notices = _notices(3, PEERS)
    assert sel.choose(3, notices, lambda n: {p: v for p, v in n.items() if p != "peer01"}) == \
        {p: v for p, v in notices.items() if p != "peer01"}
    assert sel.likely(3, notices) == notices and not sel.late_turn(3)
    assert sel.keeps_rule(3, _accepted(3, "peer00", PEERS), notices)


def test_capped_a_reserve_replaces_a_selected_sender_that_fails_admission() -> None:
    sel = Selection(1, GatherRule(size=2, reserves=1), (), RoundBans(), CommitteeRule())
    notices = _notices(5, PEERS)
    likely = sel.likely(5, notices)
    assert len(likely) == 2
    asked: list[set[str]] = []

    def admit(n: dict[str, ContribNotice]) -> dict[str, ContribNotice]:
        asked.append(set(n))
        failing = min(likely)
        return {p: v for p, v in n.items() if p != failing}

    chosen = sel.choose(5, notices, admit)
    (pool,) = asked
    assert len(pool) == 3 and set(likely) <= pool  # F + R checked, the likely ones among them
    assert len(chosen) == 2 and min(likely) not in chosen and set(chosen) <= pool


def test_a_set_over_the_cap_is_refused_and_its_coordinator_banned_once() -> None:
    bans = RoundBans()
    sel = Selection(1, GatherRule(size=2), (), bans, CommitteeRule())
    notices = _notices(4, PEERS)
    over = _accepted(4, "peer07", PEERS[:5])
    assert not sel.keeps_rule(4, over, notices)
    assert bans.banned("peer07", 5)
    assert not sel.keeps_rule(4, over, notices)  # remembered: not judged (or banned) again
    fair = _accepted(4, "peer06", list(sel.likely(4, notices)))
    assert sel.keeps_rule(4, fair, notices)
    assert sel.full_without(fair, {0}) and not sel.full_without(_accepted(4, "peer06", PEERS[:1]), {0})


def test_a_peer_without_the_standing_of_recent_rounds_takes_its_turn_last() -> None:
    sel = Selection(1, GatherRule(size=2, memory=4), ("peer05",), RoundBans(), CommitteeRule())
    assert sel.late_turn(10)
    assert sel.veterans(10) == {"peer05": 6}  # the allow-list's peers have standing from the start
    for r in range(6, 10):
        sel.took(r, _accepted(r, "peer00", ["peer00", "peer01"]))
    assert not sel.late_turn(10) and set(sel.veterans(10)) == {"peer00", "peer01", "peer05"}


def test_a_resumed_peer_that_kept_its_bans_takes_the_set_an_honest_coordinator_chose() -> None:
    # the capped run of test_gather_rounds.py (F = 2, R = 1): the breaker coordinated over the cap and every honest
    # peer banned it. Round 7: c has just resumed its current checkpoint (warm standing), its notice and the
    # breaker's reached it and not the coordinator b, which took a and b. The breaker's notice counts only for a peer
    # that forgot the ban: that puts two due veterans, c and the breaker, ahead of a and b, and b's set is refused.
    sets = [("a", "b"), ("b", "c"), ("a", "b"), ("c", "breaker"), ("a", "b"), ("c", "breaker"), ("a", "b")]
    notices = _notices(7, ["a", "b", "c", "breaker"])
    honest = _accepted(7, "b", ["a", "b"])
    verdicts = []
    for kept_bans in (True, False):
        bans = RoundBans()
        if kept_bans:
            bans.ban(6, "breaker", "its set was over the cap")
        sel = Selection(1, GatherRule(size=2, reserves=1), (), bans, CommitteeRule())
        for r, members in enumerate(sets):
            sel.took(r, _accepted(r, members[0], list(members)))
        assert not sel.late_turn(7)
        verdicts.append(sel.keeps_rule(7, honest, notices))
    assert verdicts == [True, False]


def test_out_of_sync_a_peer_pardons_the_coordinators_it_judged_from_its_own_standing() -> None:
    # the resumed peer above, without its ban of the breaker: it refused b's honest set in round 7 and banned b. In
    # round 8 it finds it took a set the others did not; b's ban came from that standing and is lifted, while the ban
    # of x, whose set of round 7 was over the cap (no standing needed to see it), stays
    bans = RoundBans()
    sel = Selection(1, GatherRule(size=2, reserves=1), (), bans, CommitteeRule())
    sets = [("a", "b"), ("b", "c"), ("a", "b"), ("c", "breaker"), ("a", "b"), ("c", "breaker"), ("a", "b")]
    for r, members in enumerate(sets):
        sel.took(r, _accepted(r, members[0], list(members)))
    notices = _notices(7, ["a", "b", "c", "breaker"])
    assert not sel.keeps_rule(7, _accepted(7, "x", ["a", "b", "c"]), notices)
    assert not sel.keeps_rule(7, _accepted(7, "b", ["a", "b"]), notices)
    assert bans.banned("b", 8) and bans.refused_by_all("b", 8) and bans.banned("x", 8)
    sel.forget(8)
    assert not bans.banned("b", 8) and not bans.refused_by_all("b", 8) and "b" not in bans.until
    assert bans.banned("x", 8) and sel.late_turn(9)  # the standing is gone: cold until rebuilt
    assert sel.keeps_rule(7, _accepted(7, "b", ["a", "b"]), notices)  # judged again, by the cap alone
