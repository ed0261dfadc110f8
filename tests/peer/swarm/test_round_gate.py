"""The round gate between a stage's compute thread and its round loop (hlbp.peer.swarm.gate), with real threads."""

from __future__ import annotations

import threading

from hlbp.peer.swarm.gate import RoundGate


def test_the_drivers_round_end_mark_closes_the_gate_until_the_round_is_loaded() -> None:
    gate = RoundGate()
    assert gate.enter(1.0)
    gate.leave(True, tokens=64)
    assert gate.enter(1.0)
    gate.leave(True, tokens=64, round_end=True)  # closes at once, on the compute thread
    assert gate.closed and gate.wait_ended(0.0)
    assert gate.take() == (2, 128) and not gate.ended
    assert not gate.enter(0.05)  # a step of the next round waits (here: times out) while the gate is closed
    gate.leave(False)
    started = threading.Event()

    def next_step() -> None:
        gate.enter(5.0)
        started.set()

    t = threading.Thread(target=next_step)
    t.start()
    assert not started.wait(0.2)
    gate.open()
    assert started.wait(5.0)
    t.join()


def test_closing_between_steps_waits_for_the_step_under_way_and_gives_up_on_a_dead_one() -> None:
    gate = RoundGate()
    gate.enter(1.0)
    timer = threading.Timer(0.2, lambda: gate.leave(True, tokens=8))
    timer.start()
    assert gate.close_between_steps(5.0)  # the step ended, then the gate closed
    assert gate.take() == (1, 8)
    gate.open()
    gate.enter(1.0)  # a step whose driver never finishes it
    assert not gate.close_between_steps(0.1) and gate.closed


def test_a_step_of_a_later_round_waits_until_that_rounds_parameters_are_loaded() -> None:
    """A standby or a joiner gets no end-of-round mark: its gate is open while its round loop still has to take the
    last round's result. A step of the next round waits for it, not for the mark."""
    gate = RoundGate()
    gate.open(4)  # the parameters start round 4
    assert gate.ready_for(4) and gate.ready_for(3) and gate.ready_for(None)
    assert not gate.ready_for(5)
    assert gate.enter(1.0, 3)  # a driver behind is served (its work is its own problem)
    gate.leave(True, tokens=8)
    started = threading.Event()

    def next_round_step() -> None:
        gate.enter(5.0, 5)
        started.set()

    t = threading.Thread(target=next_round_step)
    t.start()
    assert not started.wait(0.2)  # the gate is open, yet the parameters are round 4's
    gate.open()  # a round loop that does not say the round leaves it as it was
    assert not started.wait(0.2)
    gate.open(5)
    assert started.wait(5.0)
    t.join()
    assert not gate.enter(0.05, 6)  # times out: a stuck round loop does not stop the swarm for ever
    gate.leave(False)
    assert gate.ready_for(9) and gate.enter(0.0, 9)  # a made-up far round does not hold the compute thread


def test_a_step_of_an_earlier_round_neither_counts_nor_ends_the_phase() -> None:
    """A stage peer that synced past its driver (the driver still in the round before) must not end its phase on
    the driver's mark of that round: its phase would end before the swarm's steps of this round ran, and those
    steps would be counted in the next phase, on parameters the round's result had replaced."""
    gate = RoundGate()
    gate.open(3)
    assert gate.enter(1.0, 2)
    gate.leave(True, tokens=64, round_end=True, round_=2)
    assert not gate.closed and not gate.wait_ended(0.0)
    assert gate.take() == (0, 0)
    assert gate.enter(1.0, 3)
    gate.leave(True, tokens=64, round_end=True, round_=3)
    assert gate.closed and gate.wait_ended(0.0) and gate.take() == (1, 64)
