"""The driver's inner phase (hlbp.peer.swarm.phase) on a fake driver: H steps with the last marked as the
round's end, cut short when the round closes, a step limit as StepLimitReached, abandoned steps logged and not
counted, validation when due, and its pure decisions."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hlbp.peer.swarm.driver import StepAbandoned, StepResult
from hlbp.peer.swarm.phase import (
    PhaseConfig,
    StepLimitReached,
    StickyCheck,
    SwarmPhase,
    driver_report,
    due_for_validation,
    needs_last_validation,
)
from hlbp.peer.swarm.step import Abandon
from hlbp.peer.swarm.stepper import DriverCounters


@dataclass
class FakeDriver:
    """What the phase asks of a driver; ``abandon`` lists the optimizer steps whose first try is abandoned."""

    abandon: set[int] = field(default_factory=set)
    counters: DriverCounters = field(default_factory=DriverCounters)
    calls: list[tuple[int, bool]] = field(default_factory=list)
    labels: list[tuple[int, int]] = field(default_factory=list)  # (round, inner) each step's frames carry
    evaluations: int = 0

    def wait_ready(self, timeout: float, round_: int = 0) -> bool:
        return True

    def has_chain(self) -> bool:
        return True

    def train_step(self, x: torch.Tensor, y: torch.Tensor, opt_step: int, lr: float, round_end: bool = False,
                   give_up: Any = None, round_r: int = 0, inner: int = 0) -> StepResult:
        self.calls.append((opt_step, round_end))
        self.labels.append((round_r, inner))
        if opt_step in self.abandon:
            self.abandon.discard(opt_step)
            self.counters.steps_abandoned += 1
            raise StepAbandoned(Abandon.NO_CHAIN, "no complete chain of stage peers")
        self.counters.steps += 1
        return StepResult(loss=1.0, seconds=0.1, chain=["12D3KooWstage"], retried=0)

    def evaluate(self, batches: Any) -> float | None:
        self.evaluations += 1
        return 2.0

    def busy_fractions(self, wall_s: float) -> dict[str, float]:
        return {}

    @property
    def links(self) -> Any:
        return SimpleNamespace(byte_totals=dict)


class Stream:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def batch(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append(seq)
        return torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)


class Metrics:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, **record: Any) -> None:
        self.records.append(record)


def _phase(driver: FakeDriver, closed: Any = lambda r: False, val: bool = False, **cfg: Any) -> SwarmPhase:
    saves: list[int] = []
    config = PhaseConfig(**{"inner_steps": 3, "step_tokens": 8, "eval_every": 0, **cfg})
    batches = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))] if val else []
    return SwarmPhase(driver, Stream(), batches, Metrics(), config, lr=lambda s: 1e-3, save=saves.append,
                      round_closed=closed, stop=threading.Event(), echo=lambda line: None, start_step=5)


def test_a_phase_takes_h_steps_and_marks_the_last_as_the_rounds_end() -> None:
    driver = FakeDriver()
    phase = _phase(driver)
    assert phase.run(0) == (3, 24)
    assert driver.calls == [(5, False), (6, False), (7, True)]
    assert driver.labels == [(0, 0), (0, 1), (0, 2)]  # an audit knows step 0 of the phase ran at the anchor
    assert phase.opt_step == 8 and phase.seq == 8


def test_an_abandoned_step_is_logged_uses_its_batch_and_is_tried_again() -> None:
    driver = FakeDriver(abandon={6})
    phase = _phase(driver)
    assert phase.run(4) == (3, 24)
    assert [c[0] for c in driver.calls] == [5, 6, 6, 7]
    assert driver.labels == [(4, 0), (4, 1), (4, 1), (4, 2)]  # an abandoned step applied nothing
    assert phase.stream.asked == [5, 6, 7, 8]  # type: ignore[attr-defined]
    records = phase.metrics.records  # type: ignore[attr-defined]
    assert [r.get("abandoned") for r in records] == [None, "no complete chain of stage peers", None, None]
    assert all(r["round"] == 4 for r in records) and records[1]["steps_abandoned"] == 1


def test_a_round_that_closes_without_the_swarm_ends_the_phase() -> None:
    asked: list[int] = []

    def closed(r: int) -> bool:
        asked.append(r)
        return True

    driver = FakeDriver()
    assert _phase(driver, closed).run(2) == (0, 0)
    assert asked == [2] and driver.calls == []


def test_the_step_limit_ends_the_run() -> None:
    driver = FakeDriver()
    phase = _phase(driver, max_steps=2)
    with pytest.raises(StepLimitReached):
        phase.run(0)
    assert len(driver.calls) == 2 and phase.opt_step == 7


def test_validation_when_due_and_at_the_end_unless_the_last_step_was_scored() -> None:
    driver = FakeDriver()
    phase = _phase(driver, val=True, eval_every=2)
    phase.validate_first()
    phase.run(0)  # steps 5, 6, 7: the optimizer reaches 6 and 8, both scored
    assert phase.val_losses == [2.0, 2.0, 2.0]
    phase.validate_last()
    assert driver.evaluations == 3
    assert due_for_validation(8, 2) and not due_for_validation(7, 2) and not due_for_validation(8, 0)
    assert needs_last_validation(0, 8, 2) and needs_last_validation(3, 7, 2) and needs_last_validation(3, 8, 0)
    assert not needs_last_validation(3, 8, 2)


def test_a_sticky_check_asks_at_most_every_period_and_stays_true() -> None:
    answers = [False, True, False]
    check = StickyCheck(lambda: answers.pop(0), 0.0)
    assert not check() and check() and check() and answers == [False]
    answers = [False, True]
    slow = StickyCheck(lambda: answers.pop(0), 0.3)
    assert not slow() and not slow() and answers == [True]  # asked once within the period
    time.sleep(0.35)
    assert slow() and answers == []


def test_the_report_line_says_the_counts_and_the_validation_losses() -> None:
    phase = _phase(FakeDriver())
    phase.run(0)
    summary = {**phase.summary(), "val_losses": [3.0, 2.5]}
    assert driver_report(summary).startswith("driver: 3 steps, 0 abandoned, 0 micro-batches done")
    assert driver_report(summary).endswith("validation 3.0000 -> 2.5000")
