"""The gather rule (peer/rounds/gather.py): the cap, rotation, newcomers, reserves and the member's check."""

from __future__ import annotations

import pytest

from hlbp.peer.rounds.gather import (
    Breach,
    BreachKind,
    GatherRule,
    Standing,
    breach,
    candidates,
    priority,
    select,
    take,
)

FULL = frozenset({0, 1})


def peers(n: int, prefix: str = "p") -> dict[str, frozenset[int]]:
    return {f"{prefix}{i:03d}": FULL for i in range(n)}


def test_uncapped_takes_everyone():
    pool = peers(40)
    assert sorted(select(3, pool, {}, GatherRule())) == sorted(pool)
    assert breach(3, pool, pool, Standing(8), GatherRule()) is None


def test_priority_puts_a_few_newcomers_then_due_veterans_then_the_rest():
    rule = GatherRule(size=1)  # one newcomer place; with 3 veterans, a veteran is due 3 rounds after its selection
    veterans = {"a": 5, "b": 2, "c": 9}
    order = priority(10, ["a", "b", "c", "n1", "n2", "n3"], veterans, rule)
    assert order[1:3] == ["b", "a"]  # the due veterans, selected longest ago first
    assert set(order[3:5]) | {order[0]} == {"n1", "n2", "n3"} and order[5] == "c"  # c is resting
    assert priority(10, ["a", "b", "c", "n1", "n2", "n3"], veterans, rule) == order  # deterministic


def test_take_caps_each_shard_and_passes_over_a_full_one():
    shards = {"f1": FULL, "f2": FULL, "s0": frozenset({0}), "s1": frozenset({1})}
    # two full replicas fill shard 0 and 1 at a cap of 2: the stage peers wait; at 3 both get in
    assert take(["f1", "f2", "s0", "s1"], shards, 2) == ["f1", "f2"]
    assert take(["f1", "s0", "f2", "s1"], shards, 2) == ["f1", "s0", "s1"]
    assert take(["f1", "f2", "s0", "s1"], shards, 3) == ["f1", "f2", "s0", "s1"]


def rotate(rule: GatherRule, pool: dict[str, frozenset[int]], rounds: int, standing: Standing,
           start: int = 0) -> list[list[str]]:
    out = []
    for r in range(start, start + rounds):
        chosen = select(r, pool, standing.veterans(r), rule)
        standing.record(r, chosen)
        out.append(chosen)
    return out


def test_every_peer_rotates_in_regularly():
    rule = GatherRule(size=4, reserves=2)
    pool = peers(20)
    standing = Standing(rule.memory)
    rounds = rotate(rule, pool, 40, standing)
    assert all(len(c) == 4 for c in rounds)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    gaps = []
    for r, chosen in enumerate(rounds):
        for p in chosen:
            first.setdefault(p, r)
            if p in last and r > 15:
                gaps.append(r - last[p])
            last[p] = r
    # nobody starved: newcomers enter at least newcomer_slots a round, so all are in by (N - F) / slots
    assert set(first) == set(pool) and max(first.values()) <= (20 - 4) // rule.newcomer_slots
    assert set(gaps) == {20 // 4}  # then each in turn, every N / F rounds


def test_keys_minted_by_the_thousand_win_only_the_newcomer_places():
    rule = GatherRule(size=8, reserves=4)
    honest = peers(16, "h")
    standing = Standing(rule.memory)
    rotate(rule, honest, 6, standing)  # every honest peer is a veteran now
    flood = {**honest, **peers(1000, "sybil")}
    for r in range(6, 16):
        veterans = standing.veterans(r)
        chosen = select(r, flood, veterans, rule)
        standing.record(r, chosen)
        assert len(chosen) == 8
        # each round admits at most the newcomer places of new keys; admitted, they rotate like anyone
        assert sum(p not in veterans for p in chosen) <= rule.newcomer_slots == 4
        assert r > 6 or sum(p.startswith("sybil") for p in chosen) == 4


def test_a_newcomer_gets_in_within_a_few_rounds():
    rule = GatherRule(size=4)
    veterans = peers(8)
    standing = Standing(rule.memory)
    rotate(rule, veterans, 10, standing)
    assert set(standing.veterans(10)) == set(veterans)
    pool = {**veterans, "new": FULL}
    joined = rotate(rule, pool, 1, standing, start=10)
    assert "new" in joined[0]  # the only newcomer takes the newcomer place at once


def test_reserves_replace_selected_senders_that_fail():
    rule = GatherRule(size=3, reserves=2)
    pool = peers(10)
    fetched = candidates(0, pool, {}, rule)
    assert len(fetched) == 5
    failed = set(fetched[:2])
    chosen = select(0, {p: pool[p] for p in fetched if p not in failed}, {}, rule)
    assert chosen == [p for p in fetched if p not in failed][:3]


def test_standing_is_warm_only_over_an_unbroken_record():
    s = Standing(memory=4)
    assert s.warm(0)
    s.record(0, ["a"])
    assert s.warm(1) and not s.warm(2)
    s.record(1, [])
    s.record(3, ["b"])  # round 2 missed: the record restarts at 3
    assert not s.warm(4)
    for r in range(4, 7):
        s.record(r, [])
    assert s.warm(7)
    assert s.veterans(7) == {"b": 3}  # a's selection in round 0 is older than the memory
    late = Standing(memory=4)
    late.record(5, ["x"])
    assert not late.warm(6)


def test_a_member_refuses_a_set_over_the_cap_even_when_cold():
    rule = GatherRule(size=2)
    members = peers(3)
    found = breach(7, members, members, Standing(rule.memory), rule)
    assert found == Breach(BreachKind.OVER_CAP, shard=0)


def test_a_member_refuses_a_coordinator_that_picks_its_friends():
    rule = GatherRule(size=4, reserves=2)
    pool = peers(20)
    standing = Standing(rule.memory)
    rotate(rule, pool, 8, standing)
    honest = select(8, pool, standing.veterans(8), rule)
    assert breach(8, {p: pool[p] for p in honest}, pool, standing, rule) is None
    # the coordinator swaps in the veteran selected last round: far down the order
    recent = min(p for p, x in standing.veterans(8).items() if x == 7)
    rigged = {**{p: pool[p] for p in honest[:3]}, recent: pool[recent]}
    found = breach(8, rigged, pool, standing, rule)
    assert found is not None and found.kind is BreachKind.OUT_OF_ORDER and found.peer == recent
    # a cold member cannot tell, and takes the set
    assert breach(8, rigged, pool, Standing(rule.memory), rule) is None


def test_an_honest_coordinator_that_missed_up_to_r_notices_is_not_refused():
    rule = GatherRule(size=4, reserves=3)
    pool = peers(20)
    standing = Standing(rule.memory)
    rotate(rule, pool, 8, standing)
    veterans = standing.veterans(8)
    order = priority(8, pool, veterans, rule)
    # the best-placed newcomer and the three best-placed veterans reached the coordinator after its close
    late = {order[0], *[p for p in order if p in veterans][:3]}
    seen_by_coordinator = {p: s for p, s in pool.items() if p not in late}
    chosen = select(8, seen_by_coordinator, veterans, rule)
    assert breach(8, {p: pool[p] for p in chosen}, pool, standing, rule) is None
    # past R + the newcomer places of them, its picks fall outside the first F + R here: refused
    missed_more = set([p for p in order if p in veterans][:rule.reserves + rule.newcomer_slots + 1])
    chosen = select(8, {p: s for p, s in pool.items() if p not in missed_more}, standing.veterans(8), rule)
    assert breach(8, {p: pool[p] for p in chosen}, pool, standing, rule) is not None


def test_the_rule_refuses_nonsense():
    with pytest.raises(ValueError):
        GatherRule(size=-1)
    with pytest.raises(ValueError):
        GatherRule(size=4, newcomer_share=2.0)


def test_standing_survives_a_checkpoint_only_whole_and_current():
    s = Standing(memory=4)
    for r in range(3):
        s.record(r, [f"p{r}"])
    saved = s.to_json()
    back = Standing(memory=4)
    assert back.load_json(saved, through=2) and back.warm(3) and back.veterans(3) == s.veterans(3)
    assert not back.load_json(saved, through=5) and not back.warm(6)  # a checkpoint of another round: cold
    hostile = [None, [], {"through": 2, "since": 0, "last": []}, {"through": 2, "since": True, "last": {}},
               {"through": 2, "since": 0, "last": {"p": 9}}, {"through": 2, "since": 0, "last": {"p" * 200: 1}},
               {"through": 2, "since": -1, "last": {}}]
    for raw in hostile:
        assert not back.load_json(raw, through=2) and back.last == {} and back.since is None


def test_a_closed_runs_allowed_peers_are_veterans_for_the_coordinator_and_the_check_alike():
    rule = GatherRule(size=4, reserves=0)
    allowed = peers(12)
    standing = Standing(rule.memory)
    rotate(rule, allowed, 2, standing)  # some selected so far, the others never
    veterans = {**{p: 2 - rule.memory for p in allowed}, **standing.veterans(2)}
    chosen = select(2, allowed, veterans, rule)
    assert len(chosen) == 4 and not set(chosen) & set(standing.veterans(2))  # the never-selected, oldest, go first
    members = {p: allowed[p] for p in chosen}
    assert breach(2, members, allowed, standing, rule, veterans) is None
    # checked against the standing alone they would look like four newcomers out of order
    assert breach(2, members, allowed, standing, rule) is not None
