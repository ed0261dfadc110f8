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
