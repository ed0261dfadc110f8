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
    holder,
    leads,
    relayed_to,
)
from hlbp.peer.rounds.gather import GatherRule, candidates

RULE = CommitteeRule(size=8, leads=3, samples=4)


def test_the_committee_is_the_agreed_head_and_off_means_none() -> None:
    head = [f"m{i}" for i in range(12)]
    assert committee(3, head, [], RULE) == tuple(head[:8])
    assert committee(3, head[:3], [], RULE) == tuple(head[:3])
    assert committee(3, head, [], CommitteeRule()) == ()
    assert committee(3, [], head, RULE) == ()  # nothing agreed: all-to-all
    assert leads(committee(3, head, [], RULE), RULE) == ("m0", "m1", "m2")


def test_a_committee_wider_than_the_last_set_reaches_back_to_earlier_members() -> None:
    head = ["m0", "m1", "m2"]
    earlier = [f"e{i}" for i in range(20)] + ["m1"]
    seats = committee(9, head, earlier, RULE)
    assert seats[:3] == ("m0", "m1", "m2") and len(seats) == 8 and len(set(seats)) == 8
    assert set(seats[3:]) <= set(earlier) - {"m1"}
    assert committee(9, head, reversed(earlier), RULE) == seats  # an order of the earlier members, not theirs
    assert committee(10, head, earlier, RULE)[3:] != seats[3:]


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
