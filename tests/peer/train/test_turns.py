"""Turns between training steps and side computations (hlbp.peer.train.turns): never both at once, and a waiting
side computation goes before the next step, however closely steps follow one another."""

from __future__ import annotations

import threading
import time

from hlbp.peer.train.turns import Turns


def test_a_side_computation_waits_for_the_step_under_way_and_goes_before_the_next() -> None:
    turns = Turns()
    log: list[str] = []
    in_step = threading.Event()
    release = threading.Event()

    def steps() -> None:
        with turns.step():
            log.append("step 1 begins")
            in_step.set()
            release.wait(5)
            log.append("step 1 ends")
        with turns.step():  # asked at once: the side computation waiting since step 1 goes first
            log.append("step 2")

    def side() -> None:
        in_step.wait(5)
        with turns.aside():
            log.append("side")

    trainer, exchange = threading.Thread(target=steps), threading.Thread(target=side)
    trainer.start()
    exchange.start()
    in_step.wait(5)
    deadline = time.monotonic() + 5
    while not turns.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log == ["step 1 begins"]  # the side computation is waiting, not running beside the step
    release.set()
    trainer.join(5)
    exchange.join(5)
    assert log == ["step 1 begins", "step 1 ends", "side", "step 2"]
    assert turns.step_wait_s > 0


def test_steps_and_side_computations_never_overlap() -> None:
    turns = Turns()
    inside = 0
    most = 0
    lock = threading.Lock()

    def enter() -> None:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.001)
        with lock:
            inside -= 1

    def run(turn: object, n: int) -> None:
        for _ in range(n):
            with turn():  # type: ignore[operator]
                enter()

    threads = [threading.Thread(target=run, args=(turns.step, 200)),
               *(threading.Thread(target=run, args=(turns.aside, 50)) for _ in range(3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert most == 1
