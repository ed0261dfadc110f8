"""The guard slot's bookkeeping, alone: what it keeps for a guard that comes early, whom it makes wait and how
long, and which losses count."""

from __future__ import annotations

import threading
import time

import torch

from hlbp.peer.swarm.guardslot import MAX_HELD, Delivery, GuardSlot

PARAMS = {"w": torch.ones(2)}


def _scoring(slot: GuardSlot, r: int, out: list, **kw: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(slot.score(r, PARAMS, **kw)))
    thread.start()
    return thread


def _until(fn, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_guard_that_comes_early_runs_when_its_candidate_is_held_and_a_passed_round_is_refused() -> None:
    slot = GuardSlot()
    slot.served(5)
    ran: list[str] = []
    held = Delivery.HELD  # nothing under guard yet: kept
    assert slot.deliver(5, lambda: ran.append("5"), lambda: ran.append("no 5")) is held
    assert slot.deliver(6, lambda: ran.append("6"), lambda: ran.append("no 6")) is held
    assert slot.deliver(4, lambda: ran.append("4"), lambda: ran.append("no 4")) is held
    out: list = []
    thread = _scoring(slot, 5, out, grace_s=5.0, timeout_s=5.0)
    _until(lambda: ran == ["no 4", "5"])  # round 5's ran, round 4's was answered unscored, round 6's waits
    assert slot.params(5) is PARAMS and slot.params(6) is None
    assert slot.deliver(5, lambda: None, lambda: None) is Delivery.RUN  # held now: a further guard of it runs at once
    slot.record(5, 0, 7.0)
    thread.join(timeout=10)
    assert out == [7.0] and slot.params(5) is None  # answered, and no longer held
    assert slot.deliver(5, lambda: None, lambda: None) is Delivery.REFUSED  # decided
    assert slot.deliver(4, lambda: None, lambda: None) is Delivery.REFUSED  # passed
    slot.served(6)
    thread = _scoring(slot, 6, out, grace_s=5.0, timeout_s=5.0)
    _until(lambda: ran == ["no 4", "5", "6"])
    slot.record(6, 0, 9.0)
    thread.join(timeout=10)
    assert out == [7.0, 9.0]


def test_a_standby_does_not_wait_and_a_guard_that_never_comes_costs_the_grace() -> None:
    slot = GuardSlot()
    start = time.monotonic()
    assert slot.score(3, PARAMS, grace_s=30.0) is None  # served none of round 3's steps
    assert time.monotonic() - start < 1.0
    slot.served(4)
    start = time.monotonic()
    assert slot.score(4, PARAMS, grace_s=0.5, timeout_s=30.0) is None  # no guard arrived
    assert 0.5 <= time.monotonic() - start < 5.0
    slot.served(5)
    out: list = []
    thread = _scoring(slot, 5, out, grace_s=5.0, timeout_s=0.5)
    _until(lambda: slot.params(5) is PARAMS)
    assert slot.deliver(5, lambda: None, lambda: None) is Delivery.RUN
    thread.join(timeout=10)
    assert out == [None]  # it arrived, but no loss came back before the deadline


def test_only_the_held_rounds_losses_count_and_the_wait_takes_their_mean() -> None:
    slot = GuardSlot()
    slot.served(2)
    out: list = []
    thread = _scoring(slot, 2, out, count=2, grace_s=10.0, timeout_s=10.0)
    _until(lambda: slot.params(2) is PARAMS)
    assert slot.deliver(2, lambda: None, lambda: None) is Delivery.RUN
    slot.record(1, 0, 100.0)  # another round's
    slot.record(2, MAX_HELD, 100.0)  # a micro-batch past any guard's
    slot.record(2, 0, 3.0)
    slot.record(2, 0, 50.0)  # the first loss of a micro-batch stands
    slot.record(2, 1, 5.0)
    thread.join(timeout=10)
    assert out == [4.0]


def test_at_most_max_held_guards_are_kept_and_none_far_ahead() -> None:
    slot = GuardSlot()
    slot.served(1)
    out: list = []
    _scoring(slot, 1, out, grace_s=0.1, timeout_s=0.1).join(timeout=10)
    ran: list[int] = []
    outcomes = [slot.deliver(2, lambda i=i: ran.append(i), lambda: None) for i in range(MAX_HELD + 4)]
    assert outcomes == [Delivery.HELD] * MAX_HELD + [Delivery.REFUSED] * 4
    assert slot.deliver(100, lambda: None, lambda: None) is Delivery.REFUSED  # far past this stage's round
    slot.served(2)
    _scoring(slot, 2, out, grace_s=0.1, timeout_s=0.1).join(timeout=10)
    assert ran == list(range(MAX_HELD))
