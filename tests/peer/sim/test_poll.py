"""The test harness's wait: a description that quotes a process's output is read when the wait times out."""

from __future__ import annotations

import pytest

from hlbp.peer.sim.launcher import poll


def test_poll_returns_the_first_truthy_value() -> None:
    values = iter([0, None, 3])
    assert poll(lambda: next(values), 5.0, "a value", interval=0.0) == 3


def test_a_poll_that_times_out_describes_the_state_at_the_timeout_not_at_the_start() -> None:
    log: list[str] = ["started"]

    def grow() -> bool:
        log.append(f"line {len(log)}")
        return False

    with pytest.raises(TimeoutError) as raised:
        poll(grow, 0.05, lambda: "\n".join(log), interval=0.01)
    assert log[-1] in str(raised.value) and len(log) > 2
