"""The driver's choice of chain (hlbp.peer.swarm.chains): sticky while its peers serve, a failed peer banned and
replaced, a wait that ends, and throughput measured as a median after a warm-up."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from hlbp.peer.swarm.chains import RATES_KEPT, RATES_NEEDED, Chains
from hlbp.peer.swarm.routing import Candidate


def _measured(chains: Chains, peer: str, rate: float) -> None:
    """``peer`` measured at ``rate``: a warm-up pass, then as many at ``rate`` as a measurement needs."""
    chains.measure(peer, 1.0)
    for _ in range(RATES_NEEDED):
        chains.measure(peer, rate)


def test_the_chain_sticks_until_a_peer_fails_then_moves_to_another() -> None:
    stages = [[Candidate("a1", 100.0), Candidate("a2", 100.0)], [Candidate("b1", 100.0)]]
    chains = Chains(lambda: stages, wait_s=1.0)
    assert chains.available()
    first = chains.choose(64)
    assert first is not None and first[1] == "b1" and chains.chain == first
    assert chains.choose(64) == first  # sticky
    assert chains.fail(first[0]) > 0 and chains.live() == ["b1"]
    second = chains.choose(64)
    assert second is not None and second[0] != first[0] and second[1] == "b1"
    chains.served(second)
    assert chains.live() == second


def test_without_a_complete_chain_the_wait_ends_at_its_limit_or_when_told() -> None:
    chains = Chains(lambda: [[Candidate("a1", 1.0)], []], wait_s=0.6)
    assert not chains.available()
    t0 = time.monotonic()
    assert chains.choose(64) is None
    assert 0.5 <= time.monotonic() - t0 < 5
    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    assert Chains(lambda: [[]], wait_s=30.0, stop=stop).choose(64) is None
    assert Chains(lambda: [[]], wait_s=30.0).choose(64, give_up=lambda: True) is None
    assert time.monotonic() - t0 < 5


def test_measured_throughput_is_a_median_after_the_warm_up_that_routing_prefers() -> None:
    stages = [[Candidate("slow", 1000.0), Candidate("fast", 10.0)]]
    chains = Chains(lambda: stages, wait_s=1.0)
    chains.measure("fast", 50.0)  # its first micro-batch paid the warm-up: not its rate
    assert "fast" not in chains.measured and chains.choose(64) == ["slow"]
    chains.measure("fast", 5000.0)
    chains.measure("fast", 0.0)  # two passes are not yet a measurement
    assert "fast" not in chains.measured and chains.choose(64) == ["slow"]
    chains.measure("fast", 4000.0)  # one slow pass among three does not move it
    assert chains.measured["fast"] == 4000.0
    assert [c.throughput for c in chains.options()[0]] == [1000.0, 4000.0]
    assert chains.choose(64) == ["slow"]  # the chain in use stays between phase starts
    assert chains.choose(64, switch_factor=2.0) == ["fast"]  # at one, a peer twice as fast takes over
    for _ in range(RATES_KEPT):  # the latest RATES_KEPT count: a peer that slowed down is read as slow
        chains.measure("fast", 300.0)
    assert chains.measured["fast"] == 300.0 and chains.choose(64, switch_factor=2.0) == ["slow"]


def test_a_measured_stage_rate_is_compared_with_announcements_in_full_model_tokens(caplog: Any) -> None:
    # stage 1 of 2 does half the model's compute: measured at 3000 of its tokens/s it does 1500 full-model tokens/s, which a
    # standby announcing 2500 does not beat by a factor 2; measured at 1000 (500 full-model) it does
    stage = [Candidate("held", 1000.0), Candidate("standby", 2500.0)]
    chains = Chains(lambda: [stage], wait_s=1.0, shares=[0.5])
    assert chains.choose(64) == ["standby"]  # nothing measured: the announcements decide
    chains.chain = ["held"]
    _measured(chains, "held", 3000.0)
    assert [c.throughput for c in chains.options()[0]] == [1500.0, 2500.0]
    assert chains.choose(64, switch_factor=2.0) == ["held"]
    chains.measured["held"] = 1000.0
    with caplog.at_level(logging.WARNING, "hlbp.peer.swarm.chains"):
        assert chains.choose(64, switch_factor=2.0) == ["standby"]
    # the log says each rate's unit and source
    assert "standby (2500 full-model tokens/s, announced) takes over from held (500 full-model tokens/s, measured)" \
        in caplog.text
    # unconverted, the same 3000 would read as faster than the standby's 2500
    raw = Chains(lambda: [stage], wait_s=1.0)
    _measured(raw, "held", 3000.0)
    assert raw.options()[0][0].throughput == 3000.0


def test_with_several_peers_allowed_a_stage_not_worth_sharing_switches_only_at_a_phase_start(caplog: Any) -> None:
    # 1 Mbit/s announced: a trade of 1.3 MB would take 10 s, so no stage is shared (peers may serve up to 4)
    stage = [Candidate("a", 1000.0, bandwidth=125e3), Candidate("b", 1500.0, bandwidth=125e3)]
    chains = Chains(lambda: [stage], wait_s=1.0, shares=[1.0], grad_bytes=[1_300_000])
    tokens = [256] * 4
    assert chains.pick(tokens, most=4, fresh=True, switch_factor=2.0) == [["b"]]  # none served yet: the fastest
    stage[1:] = [Candidate("b", 1500.0, bandwidth=125e3), Candidate("c", 2500.0, bandwidth=125e3)]
    # c is under twice b: b keeps the stage at the next phase's start, and within a phase c never takes it
    assert chains.pick(tokens, most=4, fresh=True, switch_factor=2.0) == [["b"]]
    stage[2] = Candidate("c", 4000.0, bandwidth=125e3)
    assert chains.pick(tokens, most=4, fresh=False, switch_factor=2.0) == [["b"]]
    with caplog.at_level(logging.WARNING, logger="hlbp.peer.swarm.chains"):
        assert chains.pick(tokens, most=4, fresh=True, switch_factor=2.0) == [["c"]] and chains.chain == ["c"]
    assert "takes over from" in caplog.text  # the driver says why the stage moved


def test_an_unmeasured_peer_beside_a_measured_one_is_routed_an_equal_part_until_measured() -> None:
    # probes on a quiet box announced 5000 each; the measured one does 400: by its announcement the unmeasured peer
    # would take every micro-batch, by a guess of 1 none
    stages = [[Candidate("a", 5000.0), Candidate("b", 5000.0)]]
    chains = Chains(lambda: stages, wait_s=1.0)
    _measured(chains, "a", 400.0)
    assert chains.routes([["a", "b"]], [64] * 4) == [["a"], ["b"], ["a"], ["b"]]
    # measured below its announcement, a peer does not make its stage's others look slow (the ratio stays 1)
    assert [c.throughput for c in chains.options(calibrated=True)[0]] == [400.0, 5000.0]
    _measured(chains, "b", 1200.0)  # measured three times as fast: three micro-batches in four
    assert sorted(r[0] for r in chains.routes([["a", "b"]], [64] * 4)) == ["a", "b", "b", "b"]
    # nothing measured on a stage: the announcements decide
    fresh = Chains(lambda: [[Candidate("a", 1000.0), Candidate("b", 3000.0)]], wait_s=1.0)
    assert sorted(r[0] for r in fresh.routes([["a", "b"]], [64] * 4)) == ["a", "b", "b", "b"]


def test_announcements_are_scaled_by_how_far_a_stage_s_measured_peers_outdo_theirs() -> None:
    # probes on a busy box read low: the measured peer does 4x what it announced, so an unmeasured peer of its
    # stage is believed 4x its announcement when several peers may serve, and taken raw by the one-peer chain
    stages = [[Candidate("a", 100.0), Candidate("b", 50.0)], [Candidate("c", 80.0)]]
    chains = Chains(lambda: stages, wait_s=1.0)
    _measured(chains, "a", 400.0)
    assert [[c.throughput for c in s] for s in chains.options(calibrated=True)] == [[400.0, 200.0], [80.0]]
    assert [[c.throughput for c in s] for s in chains.options()] == [[400.0, 50.0], [80.0]]
    # raw, b would look 8x slower and be left out; believed at half of a, it serves beside it
    assert chains.pick([64] * 4, most=2, fresh=True) == [["a", "b"], ["c"]]


def test_one_slow_pass_does_not_drop_a_peer_from_its_shared_stage_within_a_phase() -> None:
    # each peer of the shared stage served two micro-batches of the phase's first step (a warm-up and one more); the
    # one more of "b" met a busy core and reads 4.4x slower: routed by it, b would get none of the next step's four
    # micro-batches and leave the phase it is in step with
    stage = [Candidate("a", 100.0), Candidate("b", 100.0)]
    chains = Chains(lambda: [stage, [Candidate("c", 100.0)]], wait_s=1.0)
    assert chains.pick([64] * 4, most=2, fresh=True) == [["a", "b"], ["c"]]
    for peer, rate in (("a", 1.0), ("a", 400.0), ("b", 1.0), ("b", 90.0)):
        chains.measure(peer, rate)
    assert chains.pick([64] * 4, most=2) == [["a", "b"], ["c"]]
    assert sorted(r[0] for r in chains.routes([["a", "b"], ["c"]], [64] * 4)) == ["a", "a", "b", "b"]
    # measured slow again and again, it is left out: the step would wait for it
    for _ in range(RATES_NEEDED):
        chains.measure("a", 400.0)
        chains.measure("b", 90.0)
    assert chains.pick([64] * 4, most=2) == [["a"], ["c"]]
