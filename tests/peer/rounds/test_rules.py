"""The round protocol's pure decisions about closing a round: ranking, windows, turns, which accepted set wins."""

from hlbp.peer.rounds.rules import (
    adapt_window,
    coordinator_order,
    coordinator_ranking,
    dropped_named,
    holds_up,
    pick_accepted,
    widen_for_late,
)
from hlbp.protocol.roundwire import AcceptedSet, ShardChecks

PEERS = [f"12D3KooWpeer{i:02d}xxxxxxxxxxxxxxxx" for i in range(6)]


def test_coordinator_order_is_the_same_from_any_view_and_changes_by_round():
    a = coordinator_order(7, PEERS)
    assert a == coordinator_order(7, list(reversed(PEERS))) == coordinator_order(7, PEERS + PEERS[:2])
    assert sorted(a) == sorted(PEERS)
    firsts = {coordinator_order(r, PEERS)[0] for r in range(40)}
    assert len(firsts) >= 4  # the duty rotates; no peer is a fixed server


def test_only_the_head_of_the_agreed_order_holds_a_round_up_and_only_half_a_window_after_the_first_notice():
    prior = {p: frozenset({0, 1}) for p in PEERS[:4]}
    head, second = coordinator_ranking(5, prior, 2)[:2]

    def held(me: str, now: float, lead: tuple[str, ...] = (), first: float | None = 100.0) -> bool:
        return holds_up(me, 5, prior, 2, frozenset(), lead, first, now, window=6.0)

    assert not held(head, 1000.0, first=None)  # nobody announced the round yet
    assert not held(head, 102.9) and held(head, 103.0)  # half the 6 s window after the first notice
    assert not held(second, 1000.0)  # the round closes without a later peer: it holds nothing up
    assert held(second, 103.0, lead=(second, head)) and not held(head, 103.0, lead=(second, head))  # a committee
    # a peer the head's ranking puts behind others because it holds fewer shards is never first
    assert not holds_up(PEERS[5], 5, {**prior, PEERS[5]: frozenset({0})}, 2, frozenset(), (), 100.0, 1000.0, 6.0)


def test_adapt_window_follows_arrivals_within_bounds():
    assert adapt_window([0.0, 2.0], lo=1.0, hi=10.0, current=5.0) == 4.0
    assert adapt_window([0.0, 100.0], lo=1.0, hi=10.0, current=5.0) == 10.0
    assert adapt_window([0.0, 0.0], lo=2.0, hi=10.0, current=2.5) == 2.0
    assert adapt_window([0.0], lo=1.0, hi=10.0, current=5.0) == 5.0  # one arrival says nothing about spread


def test_adapt_window_grows_at_once_and_shrinks_by_a_quarter_a_round():
    window, seen = 8.0, []
    for _ in range(8):  # rounds in lockstep: the window steps down to the floor, never straight to it
        window = adapt_window([0.0, 0.1], lo=1.0, hi=30.0, current=window)
        seen.append(window)
    assert seen[:3] == [6.0, 4.5, 3.375] and seen[-1] == 1.15
    assert adapt_window([0.0, 6.0], lo=1.0, hi=30.0, current=1.15) == 10.0  # one slow round: wide at once


def test_widen_for_late_takes_back_a_near_miss_and_leaves_a_straggler_out():
    # closed after a 2 s window; the next one had shrunk to 1.5 s
    assert widen_for_late(1.5, 2.0, [2.6], hi=30.0) == 1.5 * 2.6 + 1.0  # missed by 0.6 s: the next window takes it
    assert widen_for_late(1.5, 2.0, [4.0], hi=30.0) == 7.0  # one window late still counts
    assert widen_for_late(1.5, 2.0, [4.1, 20.0], hi=30.0) == 1.5  # later than that: a straggler, never waited for
    assert widen_for_late(1.5, 2.0, [3.9], hi=5.0) == 5.0  # within the manifest's bound
    assert widen_for_late(9.0, 2.0, [2.5], hi=30.0) == 9.0  # never narrows
    assert widen_for_late(1.5, 2.0, [-1.0], hi=30.0) == 1.5  # a clock that ran backwards is no evidence


def test_pick_accepted_prefers_the_best_ranked_coordinator():
    order = coordinator_order(3, PEERS)
    sets = [AcceptedSet(order[2], 3, ()), AcceptedSet(order[1], 3, ())]
    assert pick_accepted(sets, order).coordinator == order[1]
    assert pick_accepted([], order) is None


def test_close_verdict_waits_for_the_minimum_then_closes_empty() -> None:
    from hlbp.peer.rounds.rules import Verdict, close_verdict

    assert close_verdict(3, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.MEMBERS
    assert close_verdict(2, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.WAIT
    assert close_verdict(2, 3, now=60.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.EMPTY
    # a lower-ranked coordinator gives the better-ranked ones their takeover time first
    assert close_verdict(2, 3, now=62.0, first_seen=0.0, max_window=60.0, rank=1, takeover_s=3.0) is Verdict.WAIT
    assert close_verdict(0, 1, now=0.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.WAIT


def test_round_standing_for_status() -> None:
    from hlbp.peer.rounds.rules import round_standing

    a, b = "a" * 64, "b" * 64
    sparse = [ShardChecks("p1", 5, {0: a}), ShardChecks("p2", 5, {0: a}), ShardChecks("p3", 5, {0: b}),
              ShardChecks("p4", 4, {0: a})]
    got = round_standing(sparse)
    assert got["p1"] == {"round": 5, "agrees": True} and got["p2"]["agrees"]
    assert not got["p3"]["agrees"] and got["p4"] == {"round": 4, "agrees": False}  # out of sync / behind
    dense = [ShardChecks("p1", 2, {0: a}, {0: (1.0, 5.0)}), ShardChecks("p2", 2, {0: b}, {0: (1.0 + 1e-9, 5.0)}),
             ShardChecks("p3", 2, {0: b}, {0: (2.0, 5.0)})]
    assert [round_standing(dense)[p]["agrees"] for p in ("p1", "p2", "p3")] == [True, True, False]
    assert round_standing([]) == {}


def test_coordinators_that_contributed_every_shard_rank_before_stage_peers() -> None:
    from hlbp.peer.rounds.rules import coordinator_ranking

    shards = {"stage-a": {1}, "full-b": {0, 1}, "stage-c": {0}, "full-d": {0, 1}}
    order = coordinator_ranking(7, shards, 2)
    assert order[:2] == coordinator_order(7, ["full-b", "full-d"])
    assert order[2:] == coordinator_order(7, ["stage-a", "stage-c"])
    assert coordinator_ranking(7, {"stage-a": {1}, "stage-c": {0}}, 2) == coordinator_order(7, ["stage-a", "stage-c"])


def test_contributors_behind_nat_coordinate_after_the_dialable_ones_of_their_group() -> None:
    from hlbp.peer.rounds.rules import coordinator_ranking, round_members

    shards = {"nat-a": {0, 1}, "pub-b": {0, 1}, "nat-c": {0, 1}, "pub-d": {0, 1}, "stage-e": {0}}
    order = coordinator_ranking(3, shards, 2, undialable={"nat-a", "nat-c"})
    assert order == [*coordinator_order(3, ["pub-b", "pub-d"]), *coordinator_order(3, ["nat-a", "nat-c"]), "stage-e"]
    # only peers behind NAT contributed: one of them still coordinates
    assert coordinator_ranking(3, {"nat-a": {0, 1}}, 2, undialable={"nat-a"}) == ["nat-a"]
    # the members follow the same ranking: a NATed coordinator's set loses to a dialable one's
    sets = [AcceptedSet(p, 3, ((p, 1, {0: "d"}),)) for p in ("nat-a", "pub-b")]
    assert round_members(3, shards, sets, 2, undialable={"nat-a", "nat-c"}) == frozenset({"pub-b"})


def test_round_standing_counts_a_stage_peer_that_agrees_on_its_one_shard() -> None:
    checks = [ShardChecks("full-1", 3, {0: "a", 1: "b"}), ShardChecks("full-2", 3, {0: "a", 1: "b"}),
              ShardChecks("stage-1", 3, {1: "b"}), ShardChecks("stage-0", 3, {0: "x"})]
    from hlbp.peer.rounds.rules import round_standing

    standing = round_standing(checks)
    assert standing["stage-1"]["agrees"] and standing["full-1"]["agrees"]
    assert not standing["stage-0"]["agrees"]


def test_last_rounds_members_rank_first_whoever_announced_first() -> None:
    from hlbp.peer.rounds.rules import turn_order

    prior = {"m1": {0, 1}, "m2": {0, 1}, "stage": {1}}
    notices = {"newcomer": {0, 1}, "m2": {0, 1}}  # m1 has not announced yet; a newcomer was quick
    order = turn_order(7, prior, notices, 2)
    assert order[:2] == coordinator_order(7, ["m1", "m2"]) and order[2:] == ["stage", "newcomer"]
    assert turn_order(7, {}, notices, 2) == coordinator_order(7, ["newcomer", "m2"])  # no agreed order yet


def test_a_set_counts_only_once_its_publishers_turn_has_come() -> None:
    from hlbp.peer.rounds.rules import set_counts

    order = ["first", "second", "third"]
    members = (("first", 10, {0: "a" * 64}), ("second", 10, {0: "b" * 64}))

    def counts(coordinator: str, now: float, with_members: bool = True, prior_known: bool = True,
               complete: bool = False, first_seen: float | None = 100.0, min_contributors: int = 1) -> bool:
        s = AcceptedSet(coordinator, 7, members if with_members else ())
        return set_counts(s, order, prior_known=prior_known, complete=complete, first_seen=first_seen, now=now,
                          window=4.0, max_window=30.0, takeover_s=3.0, min_contributors=min_contributors)

    assert counts("first", 100.1)  # the agreed head closes at once
    assert counts("first", 100.1, prior_known=False, complete=True)  # or once every expected contributor announced
    assert not counts("first", 103.9, prior_known=False) and counts("first", 104.0, prior_known=False)
    assert not counts("second", 106.9) and counts("second", 107.0)  # a takeover counts once it is due here
    assert not counts("third", 109.9) and counts("third", 110.0)
    assert not counts("stranger", 1e9)  # a key that is no member and contributed nothing never closes a round
    assert not counts("first", 129.9, with_members=False) and counts("first", 130.0, with_members=False)
    assert not counts("second", 132.9, with_members=False) and counts("second", 133.0, with_members=False)
    assert not counts("second", 1e9, first_seen=None)  # no notice seen: no takeover is due
    assert not counts("first", 1e9, min_contributors=3)  # fewer members than the run requires never count


def test_members_behind_nat_take_their_turn_after_the_dialable_members() -> None:
    from hlbp.peer.rounds.rules import turn_order

    prior = {"m1": {0, 1}, "m2": {0, 1}, "m3": {0, 1}}
    order = turn_order(7, prior, {"new": {0, 1}}, 2, undialable={"m1", "new"})
    assert order[:2] == coordinator_order(7, ["m2", "m3"]) and order[2:] == ["m1", "new"]


def test_a_round_is_complete_only_with_the_expected_contributors() -> None:
    from hlbp.peer.rounds.rules import UNKNOWN, Expected, complete

    expected = Expected(3, frozenset({"a", "b", "c"}))
    fakes = {f"fake{i}": None for i in range(40)}
    assert not complete({"a": None, **fakes}, expected)  # 40 notices under throwaway keys complete nothing
    assert not complete({"a", "b"}, expected)
    assert complete({"a", "b", "c", "fake1"}, expected)
    assert not complete({"a", "c"}, expected, banned=lambda p: p == "c")  # a banned sender's notice counts nothing
    assert complete({"a", "b"}, expected, banned=lambda p: p == "c")  # ... and a banned peer is not waited for
    assert not complete(set(), expected, banned=lambda p: True)  # every expected peer banned: one notice still needed
    assert complete({"a", "b", "c"}, Expected(2, frozenset({"a", "b", "c"})), banned=lambda p: p == "c")
    assert complete({"x", "y"}, Expected(2))  # only a count known (the in-process engine): any notice counts
    assert not complete({"a", "b", "c"}, UNKNOWN)  # announcements unread: the window runs out instead


def test_the_expected_contributors_are_full_replicas_and_whole_swarms() -> None:
    from dataclasses import dataclass

    from hlbp.peer.node.replica import expected_contributors

    @dataclass
    class Ann:
        role: str
        online: bool = True
        swarm: int | None = None
        stage: int | None = None

    @dataclass
    class Run:
        stages: tuple[tuple[int, int], ...] = ((0, 1), (1, 2))

        def may_contribute(self, peer: str) -> bool:
            return peer != "outsider"

    anns = {"r1": Ann("replica"), "r2": Ann("replica"), "gone": Ann("replica", online=False),
            "outsider": Ann("replica"), "s0": Ann("stage", swarm=1, stage=0), "s1": Ann("stage", swarm=1, stage=1),
            "standby": Ann("stage", swarm=1, stage=1), "half": Ann("stage", swarm=2, stage=0)}
    got = expected_contributors(anns, Run())
    assert got.count == 2 + 2  # two replicas, one per stage of the whole swarm (its standby trains nothing)
    assert got.peers == frozenset({"r1", "r2", "s0", "s1", "standby"})
    # which shards each applies, for the payload fetch trees: a full replica every one, a stage peer its stage's
    assert got.shards == {"r1": {0, 1}, "r2": {0, 1}, "s0": {0}, "s1": {1}, "standby": {1}}
    assert sorted(map(sorted, got.slots)) == [["r1"], ["r2"], ["s0"], ["s1", "standby"]]


def test_a_banned_stage_peer_whose_stage_another_peer_serves_is_still_waited_for_by_its_stage() -> None:
    from hlbp.peer.rounds.rules import Expected, complete

    # a full replica and a 3-stage swarm whose stage-1 liar was banned and replaced by a standby
    slots = (frozenset({"r"}), frozenset({"d"}), frozenset({"liar", "standby"}), frozenset({"last"}))
    expected = Expected(4, frozenset().union(*slots), None, slots)
    banned = {"liar"}.__contains__
    assert not complete({"r", "standby", "last"}, expected, banned)  # the driver, which sends last, is awaited
    assert complete({"r", "d", "standby", "last"}, expected, banned)
    # a stage no unbanned peer serves is not waited for (the swarm cannot send it)
    alone = (frozenset({"r"}), frozenset({"d"}), frozenset({"liar"}), frozenset({"last"}))
    assert complete({"r", "d", "last"}, Expected(4, frozenset().union(*alone), None, alone), banned)


def test_unannounced_keys_rank_behind_every_announced_contributor() -> None:
    from hlbp.peer.rounds.rules import turn_order

    notices = {p: {0, 1} for p in ("a", "b", "c", *(f"fake{i}" for i in range(40)))}
    order = turn_order(0, {}, notices, 2, announced={"a", "b", "c"})
    assert order[:3] == coordinator_order(0, ["a", "b", "c"])  # whoever reads the 40 fakes, the head is the same
    assert order[:3] == turn_order(0, {}, {p: {0, 1} for p in "abc"}, 2, announced={"a", "b", "c"})
    # members of the previous round still come first
    assert turn_order(1, {"fake3": {0, 1}}, notices, 2, announced={"a", "b", "c"})[0] == "fake3"


def test_a_set_names_as_dropped_only_non_members_sorted_and_no_more_than_its_members_leave_room_for() -> None:
    assert dropped_named({"c", "a", "m"}, {"m"}, 256) == ("a", "c")  # a member is never named dropped
    assert dropped_named({"c", "b", "a"}, {"m", "n"}, 4) == ("a", "b")  # 2 members leave room for 2 of 4 ids
    assert dropped_named({"a"}, {f"p{i}" for i in range(5)}, 4) == ()  # no room: nobody named, the set stays readable
