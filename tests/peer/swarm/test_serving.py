"""Several peers serving one stage (hlbp.peer.swarm.routing): which peers serve a step and which micro-batch goes
through which of them. Pure rules, no network."""

from __future__ import annotations

import pytest

from hlbp.peer.swarm.routing import Bans, Candidate, ShareCosts, assign_routes, choose_serving


def test_equal_peers_take_turns_and_a_twice_as_fast_peer_takes_twice_the_micro_batches() -> None:
    routes = assign_routes([64] * 8, [[Candidate("a", 100.0), Candidate("b", 100.0)], [Candidate("c", 50.0)]])
    assert routes == [["a", "c"], ["b", "c"]] * 4
    fast = assign_routes([64] * 9, [[Candidate("slow", 100.0), Candidate("fast", 200.0)]])
    assert sum(r == ["fast"] for r in fast) == 6 and sum(r == ["slow"] for r in fast) == 3


def test_routing_counts_tokens_already_queued_and_breaks_ties_by_peer_id() -> None:
    busy = [Candidate("a", 100.0, queued_tokens=256), Candidate("b", 100.0)]
    assert assign_routes([64] * 4, [busy]) == [["b"]] * 4
    assert assign_routes([64], [[Candidate("z", 1.0), Candidate("y", 1.0)]]) == [["y"]]
    assert assign_routes([], [[Candidate("a", 1.0)]]) == []
    with pytest.raises(ValueError):
        assign_routes([64], [[]])


def test_at_a_phase_start_the_fastest_peers_serve_and_one_too_slow_for_any_micro_batch_is_left_out() -> None:
    stage = [Candidate("c", 40.0), Candidate("a", 100.0), Candidate("b", 90.0), Candidate("d", 1.0)]
    serving = choose_serving([stage], [["d"]], Bans(), 0.0, [64] * 8, most=3, fresh=True)
    assert serving == [["a", "b", "c"]]
    assert choose_serving([stage], [], Bans(), 0.0, [64] * 4, most=3, fresh=True) == [["a", "b"]]  # c gets none
    assert choose_serving([stage], [], Bans(), 0.0, [64] * 8, most=2, fresh=True) == [["a", "b"]]


def test_within_a_phase_a_stage_keeps_its_peers_and_never_adds_one() -> None:
    stage = [Candidate("a", 100.0), Candidate("b", 100.0), Candidate("c", 1000.0)]
    assert choose_serving([stage], [["a", "b"]], Bans(), 0.0, [64] * 8, most=3, fresh=False) == [["a", "b"]]
    bans = Bans()
    bans.fail("a", 0.0)
    assert choose_serving([stage], [["a", "b"]], bans, 1.0, [64] * 8, most=3, fresh=False) == [["b"]]
    bans.fail("b", 0.0)
    # every serving peer failed: a lone replacement, which starts from its own weights
    assert choose_serving([stage], [["a", "b"]], bans, 1.0, [64] * 8, most=3, fresh=False) == [["c"]]
    bans.fail("c", 0.0)
    assert choose_serving([stage], [["a", "b"]], bans, 1.0, [64] * 8, most=3, fresh=False) is None


def test_one_peer_per_stage_is_the_sticky_chain_with_its_switch_at_a_phase_start() -> None:
    stage = [Candidate("a", 100.0), Candidate("b", 300.0)]
    assert choose_serving([stage], [["a"]], Bans(), 0.0, [64], most=1, fresh=False) == [["a"]]
    assert choose_serving([stage], [["a"]], Bans(), 0.0, [64], most=1, fresh=True) == [["a"]]
    assert choose_serving([stage], [["a"]], Bans(), 0.0, [64], most=1, fresh=True, switch_factor=2.0) == [["b"]]
    assert choose_serving([stage], [["a"]], Bans(), 0.0, [64], most=1, fresh=False, switch_factor=2.0) == [["a"]]


def test_a_re_run_keeps_each_micro_batch_on_the_peer_that_accumulated_it_where_that_peer_still_serves() -> None:
    old = [["a", "c"], ["b", "c"], ["a", "c"], ["b", "c"]]
    # stage 2's c failed and d replaces it; stage 1 keeps its split
    new = assign_routes([64] * 4, [[Candidate("a", 100.0), Candidate("b", 100.0)], [Candidate("d", 100.0)]], old)
    assert new == [["a", "d"], ["b", "d"], ["a", "d"], ["b", "d"]]
    # b failed: its micro-batches go to a, a's stay with a
    alone = assign_routes([64] * 4, [[Candidate("a", 100.0)], [Candidate("c", 100.0)]], old)
    assert alone == [["a", "c"]] * 4
    # a kept micro-batch counts in its peer's queue: the others go to the emptier peer
    fresh = assign_routes([64] * 3, [[Candidate("a", 100.0), Candidate("e", 100.0)]], [["a"], ["b"], ["b"]])
    assert fresh == [["a"], ["e"], ["a"]]  # the last a tie, to the lower id


def _two_stages(bandwidth: float) -> list[list[Candidate]]:
    """Stage 1 slow (1,000 full-model tokens/s a peer: 2 s of a 4,096-token step at half the model's compute) and
    stage 2 ten times faster, two peers each, every one announcing ``bandwidth`` bytes/s."""
    return [[Candidate("a", 1000.0, bandwidth=bandwidth), Candidate("b", 1000.0, bandwidth=bandwidth)],
            [Candidate("c", 10000.0, bandwidth=bandwidth), Candidate("d", 10000.0, bandwidth=bandwidth)]]


COSTS = ShareCosts(grad_bytes=[1_300_000, 1_300_000], shares=[0.5, 0.5])  # tiny's middle stage: 1.3 MB of fp32


def test_with_costs_only_the_bottleneck_stage_is_shared_and_only_where_its_trade_is_cheap() -> None:
    tokens = [256] * 16
    fast = choose_serving(_two_stages(12.5e6), [], Bans(), 0.0, tokens, most=2, fresh=True, costs=COSTS)
    assert fast == [["a", "b"], ["c"]]  # 100 Mbit/s: a 0.1 s trade halves 2 s; stage 2 would only add its trade
    slow = choose_serving(_two_stages(125e3), [], Bans(), 0.0, tokens, most=2, fresh=True, costs=COSTS)
    assert slow == [["a"], ["c"]]  # 1 Mbit/s: the trade (10 s) costs more than the second peer saves
    unknown = choose_serving(_two_stages(0.0), [], Bans(), 0.0, tokens, most=2, fresh=True, costs=COSTS)
    assert unknown == [["a"], ["c"]]  # no announced bandwidth: no trade is assumed cheap
    # without costs every stage takes its fastest peers, as the rule always did
    assert choose_serving(_two_stages(0.0), [], Bans(), 0.0, tokens, most=2, fresh=True) == [["a", "b"], ["c", "d"]]
    # shared ends measured at 3 s (a long chain round trip): the 1 s a second peer saves does not pay for them
    slow_ends = ShareCosts(COSTS.grad_bytes, COSTS.shares, end_s=3.0)
    assert choose_serving(_two_stages(12.5e6), [], Bans(), 0.0, tokens, most=2, fresh=True,
                          costs=slow_ends) == [["a"], ["c"]]
    # within a phase the costs change nothing: the peers of the phase's first step stay
    assert choose_serving(_two_stages(125e3), [["a", "b"], ["c"]], Bans(), 0.0, tokens, most=2, fresh=False,
                          costs=COSTS) == [["a", "b"], ["c"]]


def test_share_costs_estimate_each_stages_seconds_from_its_share_and_the_slowest_link() -> None:
    peers = [Candidate("a", 1000.0, bandwidth=1e6), Candidate("b", 3000.0, bandwidth=4e6)]
    assert COSTS.work_s(0, peers[:1], [256] * 4) == pytest.approx(1024 * 0.5 / 1000)
    # b, three times as fast, takes three of the four micro-batches: both finish at the same time
    assert COSTS.work_s(0, peers, [256] * 4) == pytest.approx(256 * 0.5 / 1000)
    assert COSTS.trade_s(0, peers[:1]) == 0.0
    assert COSTS.trade_s(0, peers) == pytest.approx(1_300_000 / 1e6)  # the slower link's download
    three = [*peers, Candidate("c", 1000.0, bandwidth=2e6)]
    assert COSTS.trade_s(0, three) == pytest.approx(2 * 1_300_000 / 1e6)  # each downloads two parts


def test_a_stage_that_sharing_does_not_pay_for_keeps_its_peer_as_with_one_peer_a_stage() -> None:
    # 1 Mbit/s: no stage is shared, so each keeps the peer that served it, as with most=1 (not the fastest)
    slow = [[Candidate("a", 1000.0, bandwidth=125e3), Candidate("b", 1500.0, bandwidth=125e3)],
            [Candidate("c", 10000.0, bandwidth=125e3), Candidate("d", 12000.0, bandwidth=125e3)]]
    tokens = [256] * 16
    kept = choose_serving(slow, [["a"], ["c"]], Bans(), 0.0, tokens, most=8, fresh=True, switch_factor=2.0,
                          costs=COSTS)
    assert kept == [["a"], ["c"]]
    # a peer at least switch_factor times faster takes the stage at a phase's start, as with most=1
    faster = [[*slow[0], Candidate("e", 2500.0, bandwidth=125e3)], slow[1]]
    assert choose_serving(faster, [["a"], ["c"]], Bans(), 0.0, tokens, most=8, fresh=True, switch_factor=2.0,
                          costs=COSTS) == [["e"], ["c"]]
    # a stage that served shared last phase and is not shared now keeps the first of its peers
    assert choose_serving(slow, [["a", "b"], ["c"]], Bans(), 0.0, tokens, most=8, fresh=True, switch_factor=2.0,
                          costs=COSTS) == [["a"], ["c"]]
    # the same views with most=1 choose the same peers
    for view, current in ((slow, [["a"], ["c"]]), (faster, [["a"], ["c"]])):
        assert choose_serving(view, current, Bans(), 0.0, tokens, most=1, fresh=True, switch_factor=2.0) == \
            choose_serving(view, current, Bans(), 0.0, tokens, most=8, fresh=True, switch_factor=2.0, costs=COSTS)
    # a banned holder gives way to the best usable peer
    bans = Bans()
    bans.fail("a", 0.0)
    assert choose_serving(slow, [["a"], ["c"]], bans, 1.0, tokens, most=8, fresh=True, switch_factor=2.0,
                          costs=COSTS) == [["b"], ["c"]]
