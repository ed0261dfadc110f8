"""The order of a stage peer's rounds under :class:`~hlbp.peer.rounds.beside.BesideLoop`: each round settled in
the foreground, its verification beside the next phase, its report one round late.

The round loop is a scripted stand-in with the loop's own :class:`RoundStats`, :class:`Scored` and threads: what is
under test is the sequencing (which thread does what, in which order, and what a resync does to the next phase),
not the protocol, which the process tests of stage peers run for real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from hlbp.peer.rounds.beside import BesideLoop
from hlbp.peer.rounds.config import RoundStats
from hlbp.peer.rounds.report import Scored
from hlbp.peer.swarm.transcript import Transcript
from hlbp.protocol.roundwire import ShardChecks


@dataclass
class _Anchor:
    def snapshot(self) -> dict:
        return {}


@dataclass
class _State:
    round: int = 0
    anchor: _Anchor = field(default_factory=_Anchor)


@dataclass
class _Settled:
    accepted: object | None
    started: float


class _Loop:
    """Rounds whose verification of round ``resync_at`` resyncs (to the state of round ``resync_to``), and which
    close without a set from ``abandon_at`` on (the peer then stops)."""

    def __init__(self, resync_at: int = -1, abandon_at: int = 99, resync_to: int | None = None,
                 waits: bool = True) -> None:
        self.state = _State()
        self.stop = threading.Event()
        self.taint = None
        self.overlapping = False
        self.resync_at, self.abandon_at = resync_at, abandon_at
        self.resync_to = resync_to  # the round the resync's state is at (None: the one after the verified one)
        self.waits = waits  # whether a verification ends only once the next phase has started
        self.phases: dict[int, threading.Event] = {}  # set as each phase starts
        self.log: list[tuple[Any, ...]] = []
        self.reports: list[tuple[int, float | None, float]] = []
        self.loaded = 0

    def begin_round(self, r: int) -> tuple[RoundStats, int, int, int]:
        self.log.append(("phase", r, self.overlapping))
        self.phases.setdefault(r, threading.Event()).set()
        return RoundStats(round=r, compute_s=1.0), 10, 100, 0

    def contribute(self, r: int, stats: RoundStats, steps: int, tokens: int, base: Mapping[str, Any]) -> dict:
        self.log.append(("contribute", r, steps, tokens))
        return {}

    def settle(self, r: int, stats: RoundStats, mine: dict, start: Any = None) -> _Settled:
        self.log.append(("settle", r, self.overlapping))
        stats.phases["apply"] = 0.01
        return _Settled(None if r >= self.abandon_at else object(), time.perf_counter())

    def confirm(self, r: int, stats: RoundStats, settled: _Settled) -> ShardChecks:
        assert self.overlapping  # the next phase owns the model meanwhile
        # the verification ends once the next phase has started, or the test lets it (release)
        if self.waits:
            assert self.phases.setdefault(r + 1, threading.Event()).wait(10.0)
        if r == self.resync_at:
            stats.synced = True
            # the agreed state of round r (or of a later one, for a peer that fell behind), fetched from the members
            self.state.round = (r if self.resync_to is None else self.resync_to) + 1
        self.log.append(("confirmed", r, threading.current_thread() is threading.main_thread()))
        return ShardChecks("me", r, {0: f"round {r}"})

    @property
    def reporter(self) -> _Loop:
        return self

    def release(self) -> None:
        """Let every verification end (the test is finishing the loop)."""
        for r in range(self.state.round + 2):
            self.phases.setdefault(r, threading.Event()).set()

    def score(self, _params: Any) -> float:
        return float(self.state.round)  # scored right after the settle: the round just applied

    def bytes_served(self) -> int:
        return 0

    def report(self, stats: RoundStats, mine: ShardChecks, steps: int, params: Any = None,
               scored: Scored | None = None) -> RoundStats:
        assert scored is not None and mine.round == stats.round
        self.reports.append((stats.round, scored.loss, stats.comm_s))
        return stats

    def load_anchor_into_model(self) -> None:
        assert not self.overlapping
        self.loaded += 1

    def save_if_due(self) -> None:
        self.log.append(("save", self.state.round))


def test_each_round_is_settled_first_and_reported_after_the_next_phase() -> None:
    run = _Loop()
    loop = BesideLoop(run)
    assert loop.run_round() is None  # round 0 settled; its verification runs on
    assert run.state.round == 1 and run.overlapping
    reported = loop.run_round()  # phase 1 beside round 0's verification, then round 1 settled
    assert reported is not None and reported.round == 0
    assert ("phase", 1, True) in run.log  # the next phase ran while round 0 was being verified
    assert next(e for e in run.log if e[0] == "confirmed") == ("confirmed", 0, False)  # on the worker thread
    run.release()
    last = loop.finish()
    assert last is not None and last.round == 1 and not run.overlapping
    # the loss scored right after each settle (state.round was r + 1 then), and only the foreground's seconds
    assert [(r, loss) for r, loss, _ in run.reports] == [(0, 1.0), (1, 2.0)]
    assert all(comm < 5.0 for _, _, comm in run.reports)  # the verification's wait ran beside the phase
    assert ("save", 1) in run.log  # saved once round 0 was verified


def test_a_round_is_reported_as_soon_as_it_is_verified_not_at_the_next_phases_end() -> None:
    run = _Loop()
    loop = BesideLoop(run)
    loop.run_round()
    assert run.reports == []  # round 0's verification waits here until phase 1 starts (the fake's condition)
    run.phases.setdefault(1, threading.Event()).set()  # as if phase 1 had begun and were still training
    deadline = time.monotonic() + 10.0
    while not run.reports and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r for r, _, _ in run.reports] == [0]  # reported from the worker, before any join
    run.release()
    loop.finish()


def test_a_resync_makes_the_next_phase_sit_out_and_its_loss_unreported() -> None:
    run = _Loop(resync_at=0)
    loop = BesideLoop(run)
    loop.run_round()
    loop.run_round()  # phase 1 trained from round 0's unverified result, which the verification replaced
    assert ("contribute", 1, 0, 0) in run.log  # so its steps are not contributed
    assert run.reports == [(0, None, run.reports[0][2])]  # the loss scored before the resync is not reported
    loop.run_round()
    assert ("contribute", 2, 10, 100) in run.log  # the phase after trains and contributes again
    run.release()
    loop.finish()


@pytest.mark.parametrize("resync_to", [0, 19])
def test_a_phase_after_a_resync_that_is_over_starts_from_the_state_it_loaded(resync_to: int) -> None:
    run = _Loop(resync_at=0, resync_to=resync_to, waits=False)
    loop = BesideLoop(run)
    loop.run_round()
    deadline = time.monotonic() + 10.0
    while not loop.inflight.future.done() and time.monotonic() < deadline:  # the verification resyncs at once
        time.sleep(0.01)
    reported = loop.run_round()
    assert reported is not None and reported.round == 0 and reported.synced
    # the model was loaded with the agreed state before the phase, which runs as that state's round with nothing
    # beside it (a phase from the replaced parameters under these labels is what an audit convicts)
    assert run.loaded == 1
    assert ("phase", resync_to + 1, False) in run.log and ("contribute", resync_to + 1, 10, 100) in run.log
    assert not any(e[0] == "phase" and e[1] == 1 and resync_to for e in run.log)
    run.release()
    loop.finish()


def test_a_round_abandoned_on_stop_keeps_its_number_and_is_not_reported() -> None:
    run = _Loop(abandon_at=1)
    loop = BesideLoop(run)
    loop.run_round()
    run.stop.set()
    assert loop.run_round() is not None  # round 0's report
    assert run.state.round == 1  # round 1 closed without a set while stopping: not counted
    run.release()
    assert loop.finish() is None
    assert [r for r, _, _ in run.reports] == [0]


class _Taint:
    """A stage's taint over a real transcript: what the loop says of its phases, as the stage's index shows it."""

    def __init__(self) -> None:
        self.transcript = Transcript()

    def phase_started(self, r: int) -> None:
        self.transcript.phase_started(r)

    def withdraw_phase(self, r: int) -> None:
        self.transcript.withdraw_phase(r)


def test_a_resync_under_a_phase_withdraws_that_phase_from_the_audits() -> None:
    run = _Loop(resync_at=0)
    run.taint = taint = _Taint()
    loop = BesideLoop(run)
    loop.run_round()
    loop.run_round()  # phase 1 trained from round 0's unverified result, which the verification replaced
    assert taint.transcript.withdrawn(1) and not taint.transcript.withdrawn(0)
    loop.run_round()
    run.release()
    loop.finish()
    assert [r for r in range(4) if taint.transcript.withdrawn(r)] == [1]


@pytest.mark.parametrize("resync_to", [0, 19])
def test_a_resync_over_before_the_phase_withdraws_nothing(resync_to: int) -> None:
    run = _Loop(resync_at=0, resync_to=resync_to, waits=False)
    run.taint = taint = _Taint()
    loop = BesideLoop(run)
    loop.run_round()
    deadline = time.monotonic() + 10.0
    while not loop.inflight.future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.run_round()  # the phase ran from the state the resync loaded
    run.release()
    loop.finish()
    assert not any(taint.transcript.withdrawn(r) for r in range(resync_to + 3))


def test_finish_after_a_resync_loads_the_agreed_state_into_the_model() -> None:
    run = _Loop(resync_at=0)
    loop = BesideLoop(run)
    loop.run_round()
    run.release()
    assert loop.finish() is not None and run.loaded == 1


def test_a_failed_verification_is_raised_at_the_join_and_frees_the_model() -> None:
    run = _Loop()

    def broken(*_args: Any) -> ShardChecks:
        raise RuntimeError("the DHT went away")

    run.confirm = broken  # type: ignore[method-assign]
    loop = BesideLoop(run)
    loop.run_round()
    run.release()
    with pytest.raises(RuntimeError, match="DHT"):
        loop.finish()
    assert not run.overlapping
