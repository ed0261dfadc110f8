"""The round protocol's pure decisions: ranking, windows, which accepted set wins, majorities, checksums."""

import torch

from hlbp.peer.rounds.rules import (
    adapt_window,
    coordinator_order,
    majority_checksums,
    pick_accepted,
)
from hlbp.peer.rounds.statesync import shard_checksum
from hlbp.protocol.roundrecords import AcceptedSet, ShardChecks

PEERS = [f"12D3KooWpeer{i:02d}xxxxxxxxxxxxxxxx" for i in range(6)]


def test_coordinator_order_is_the_same_from_any_view_and_changes_by_round():
    a = coordinator_order(7, PEERS)
    assert a == coordinator_order(7, list(reversed(PEERS))) == coordinator_order(7, PEERS + PEERS[:2])
    assert sorted(a) == sorted(PEERS)
    firsts = {coordinator_order(r, PEERS)[0] for r in range(40)}
    assert len(firsts) >= 4  # the duty rotates; no peer is a fixed server


def test_adapt_window_follows_arrivals_within_bounds():
    assert adapt_window([0.0, 2.0], lo=1.0, hi=10.0, current=5.0) == 4.0
    assert adapt_window([0.0, 100.0], lo=1.0, hi=10.0, current=5.0) == 10.0
    assert adapt_window([0.0, 0.0], lo=2.0, hi=10.0, current=5.0) == 2.0
    assert adapt_window([0.0], lo=1.0, hi=10.0, current=5.0) == 5.0  # one arrival says nothing about spread


def test_pick_accepted_prefers_the_best_ranked_coordinator():
    order = coordinator_order(3, PEERS)
    sets = [AcceptedSet(order[2], 3, ()), AcceptedSet(order[1], 3, ())]
    assert pick_accepted(sets, order).coordinator == order[1]
    assert pick_accepted([], order) is None


def test_majority_checksums_per_shard_and_round():
    checks = [
        ShardChecks(PEERS[0], 4, {0: "a" * 64, 1: "b" * 64}),
        ShardChecks(PEERS[1], 4, {0: "a" * 64, 1: "c" * 64}),
        ShardChecks(PEERS[2], 4, {0: "d" * 64, 1: "c" * 64}),
        ShardChecks(PEERS[3], 3, {0: "e" * 64, 1: "e" * 64}),  # an older round does not vote
    ]
    assert majority_checksums(checks, 4) == {0: "a" * 64, 1: "c" * 64}


def test_shard_checksum_sees_every_bit():
    params = {"a": torch.zeros(3, 4), "b": torch.ones(5)}
    ref = shard_checksum(params, ["a", "b"])
    assert ref == shard_checksum({"b": torch.ones(5), "a": torch.zeros(3, 4)}, ["b", "a"])
    params["a"][1, 2] = 1e-30
    assert shard_checksum(params, ["a", "b"]) != ref


def test_close_verdict_waits_for_the_minimum_then_closes_empty() -> None:
    from hlbp.peer.rounds.rules import close_verdict

    assert close_verdict(3, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) == "members"
    assert close_verdict(2, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) == "wait"
    assert close_verdict(2, 3, now=60.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) == "empty"
    # a lower-ranked coordinator gives the better-ranked ones their takeover time first
    assert close_verdict(2, 3, now=62.0, first_seen=0.0, max_window=60.0, rank=1, takeover_s=3.0) == "wait"
    assert close_verdict(0, 1, now=0.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) == "wait"


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


def test_round_standing_counts_a_stage_peer_that_agrees_on_its_one_shard() -> None:
    checks = [ShardChecks("full-1", 3, {0: "a", 1: "b"}), ShardChecks("full-2", 3, {0: "a", 1: "b"}),
              ShardChecks("stage-1", 3, {1: "b"}), ShardChecks("stage-0", 3, {0: "x"})]
    from hlbp.peer.rounds.rules import round_standing

    standing = round_standing(checks)
    assert standing["stage-1"]["agrees"] and standing["full-1"]["agrees"]
    assert not standing["stage-0"]["agrees"]
