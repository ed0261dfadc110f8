"""The committee's pure rules: seats, holders, what a holder forwards, relays and the checks sample."""

from __future__ import annotations

import random

import pytest

from hlbp.peer.rounds.committee import (
    MAX_COMMITTEE,
    CommitteeRule,
    check_sample,
    committee,
    forwarded,
    gone,
    holder,
    holders,
    leads,
    notice_to,
    order_checked,
    part_of,
    parts_in,
    relayed_to,
)
from hlbp.peer.rounds.gather import BreachKind, GatherRule, Standing, breach, candidates, priority

RULE = CommitteeRule(size=8, leads=3, samples=4)


def test_the_committee_fills_its_seats_from_the_newest_rounds_first() -> None:
    rounds = [[f"a{i}" for i in range(3)], [f"b{i}" for i in range(4)], [f"c{i}" for i in range(20)]]
    seats = committee(9, rounds, RULE)
    assert len(seats) == 8 and len(set(seats)) == 8
    assert set(seats[:3]) == set(rounds[0]) and set(seats[3:7]) == set(rounds[1]) and set(seats[7:]) < set(rounds[2])
    assert leads(seats, RULE) == seats[:3]
    # the same members in another order give the same seats; another round ranks them anew
    assert committee(9, [list(reversed(x)) for x in rounds], RULE) == seats
    assert committee(10, rounds, RULE)[7:] != seats[7:] or committee(11, rounds, RULE)[7:] != seats[7:]
    # a member of several rounds takes one seat
    assert committee(9, [["x", "y"], ["y", "z"]], RULE) in (("x", "y", "z"), ("y", "x", "z"))


def test_no_committee_when_the_rule_is_off_or_round_r_minus_2_had_no_members() -> None:
    assert committee(3, [["a", "b"]], CommitteeRule()) == ()
    assert committee(3, [[], ["a", "b"]], RULE) == ()
    assert committee(3, [], RULE) == ()


@pytest.mark.parametrize("bad", [{"size": -1}, {"size": MAX_COMMITTEE + 1}, {"size": 4, "leads": 0},
                                 {"size": 4, "samples": 0}])
def test_a_committee_rule_out_of_bounds_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CommitteeRule(**bad)


def test_notices_spread_over_the_holders_and_never_reach_a_lead() -> None:
    seats = tuple(f"c{i}" for i in range(32))
    senders = [f"p{i}" for i in range(3000)]
    counts: dict[str, int] = {}
    for p in senders:
        h = holder(7, p, seats, CommitteeRule(size=32))
        counts[h] = counts.get(h, 0) + 1
    assert set(counts) == set(seats[3:])  # 29 holders, every one used, the leads none
    assert max(counts.values()) < 2 * 3000 / 29
    # the same inputs give the same holder (every peer computes it), another round another spread
    assert holder(7, "p1", seats, RULE) == holder(7, "p1", seats, RULE)
    assert [holder(7, p, seats, RULE) for p in senders[:50]] != [holder(8, p, seats, RULE) for p in senders[:50]]
    # a committee of leads only: they hold the notices themselves
    assert holder(3, "p1", ("a", "b", "c"), RULE) in ("a", "b", "c")


def test_a_holder_gone_from_the_announcements_is_not_waited_for_and_its_senders_reach_the_leads() -> None:
    seats = tuple(f"c{i}" for i in range(8))
    dead = seats[5]
    online = set(seats) - {dead} | {f"p{i}" for i in range(40)}
    assert holders(seats, RULE) == seats[3:]
    assert gone(seats, RULE, online) == {dead}
    # unknown announcements (a failed read): nobody is gone; a dead lead is no holder, its turn passes by takeover
    assert gone(seats, RULE, None) == frozenset()
    assert gone(seats, RULE, online - {seats[0]}) == {dead}
    senders = [f"p{i}" for i in range(40)]
    held_by_dead = [p for p in senders if holder(4, p, seats, RULE) == dead]
    assert held_by_dead  # 40 senders over 5 holders
    for p in senders:
        targets = notice_to(4, p, seats, RULE, online)
        if p in held_by_dead:  # still to its holder (a stale view may miss a live one), and to every lead
            assert targets == {dead, *seats[:3]}
        else:
            assert targets == {holder(4, p, seats, RULE)}
        assert notice_to(4, p, seats, RULE, None) == {holder(4, p, seats, RULE)}


def test_a_lead_has_every_part_when_the_live_holders_told_it_and_a_gone_holders_senders_reached_it() -> None:
    seats = tuple(f"c{i}" for i in range(8))
    lead, dead = seats[0], seats[5]
    expected = {f"p{i}" for i in range(40)}
    live = set(seats[3:]) - {dead}
    dead_part = part_of(4, dead, seats, RULE, expected)
    assert dead_part and all(holder(4, p, seats, RULE) == dead for p in dead_part)
    everyone = set(expected)
    # every live holder told, nobody is away: the dead holder's part is still awaited (it never tells)
    assert not parts_in(4, lead, seats, RULE, live, everyone, expected)
    # away: its senders' notices reached the lead directly, so the parts are in
    assert parts_in(4, lead, seats, RULE, live, everyone, expected, away={dead})
    # ... but not while one of them is missing, nor while a live holder has not told
    assert not parts_in(4, lead, seats, RULE, live, everyone - {min(dead_part)}, expected, away={dead})
    assert not parts_in(4, lead, seats, RULE, live - {seats[3]}, everyone, expected, away={dead})
    # the expected contributors unknown: no part of an away holder can be judged complete
    assert not parts_in(4, lead, seats, RULE, live, everyone, None, away={dead})
    # a committee of leads only: a lead holds a part, complete once its senders are in
    small = ("a", "b", "c")
    mine = part_of(2, "a", small, RULE, expected)
    assert parts_in(2, "a", small, RULE, {"b", "c"}, mine, expected)
    assert not mine or not parts_in(2, "a", small, RULE, {"b", "c"}, set(), expected)


def test_each_contributor_is_relayed_the_set_by_exactly_its_holder() -> None:
    seats = tuple(f"c{i}" for i in range(8))
    senders = {f"p{i}" for i in range(200)} | set(seats)
    relayed = [relayed_to(5, c, seats, senders, RULE) for c in seats]
    assert sum(len(x) for x in relayed) == len(senders) - sum(1 for c in seats if holder(5, c, seats, RULE) == c)
    for p in senders:
        assert sum(p in x for x in relayed) == (0 if holder(5, p, seats, RULE) == p else 1)


@pytest.mark.parametrize("seed", range(20))
def test_the_parts_forwards_hold_every_contribution_the_coordinator_would_check(seed: int) -> None:
    rng = random.Random(seed)
    rule = GatherRule(size=rng.choice([2, 4, 8]), reserves=rng.choice([0, 2, 4]))
    r = rng.randrange(300, 600)
    shards = frozenset({0, 1})
    senders = [f"p{i}" for i in range(rng.randrange(20, 200))]
    veterans = {p: r - rng.randrange(1, 200) for p in senders if rng.random() < 0.6}
    seats = tuple(f"c{i}" for i in range(rng.randrange(3, 12)))
    parts: dict[str, dict[str, frozenset[int]]] = {}
    for p in senders:
        parts.setdefault(holder(r, p, seats, RULE), {})[p] = shards
    seen = {p: shards for part in parts.values() for p in (forwarded(r, part, veterans, rule))}
    want = candidates(r, {p: shards for p in senders}, veterans, rule)
    assert set(want) <= set(seen)
    assert candidates(r, seen, veterans, rule) == want  # the coordinator checks the same ones as with every notice
    assert all(len(forwarded(r, part, veterans, rule)) <= rule.size + rule.reserves for part in parts.values())


def test_uncapped_a_holder_forwards_its_whole_part() -> None:
    part = {"b": frozenset({0}), "a": frozenset({0})}
    assert forwarded(1, part, {}, GatherRule()) == ["a", "b"]


def test_the_checks_sample_is_a_few_other_members_and_spreads_the_reads() -> None:
    members = [f"m{i}" for i in range(8)]
    got = check_sample(4, "m0", members, RULE)
    assert len(got) == 4 and "m0" not in got and set(got) <= set(members)
    assert check_sample(4, "m0", members, RULE) == got
    assert check_sample(4, "m0", ["m0", "m1"], RULE) == ["m1"]
    reads: dict[str, int] = {}
    for i in range(800):
        for m in check_sample(4, f"x{i}", members, RULE):
            reads[m] = reads.get(m, 0) + 1
    assert set(reads) == set(members) and max(reads.values()) < 2 * 800 * 4 / 8


def test_with_a_committee_every_peer_checks_only_the_cap_from_round_2_on() -> None:
    """Peers see different notices with a committee, so an order check would split them: only the cap is judged,
    which every peer judges alike."""
    rule = CommitteeRule(5)
    assert order_checked(0, rule) and order_checked(1, rule) and not order_checked(2, rule)
    assert all(order_checked(r, CommitteeRule(0)) for r in range(5))
    gather = GatherRule(size=2, reserves=1)
    standing = Standing(gather.memory)
    pool = {f"p{i}": frozenset({0}) for i in range(8)}
    for r in range(4):  # everybody becomes a veteran
        standing.record(r, [f"p{2 * r}", f"p{2 * r + 1}"])
    order = priority(4, pool, standing.veterans(4), gather)
    honest_view = {p: pool[p] for p in order[:2]}
    late = {order[-1]: pool[order[-1]]}  # a member the full view ranks last: a peer that saw every notice refuses
    assert breach(4, late, pool, standing, gather) is not None
    assert breach(4, late, late, standing, gather) is None  # judged on the set alone, it is kept
    over = {**honest_view, **late}
    found = breach(4, over, over, standing, gather)
    assert found is not None and found.kind is BreachKind.OVER_CAP
