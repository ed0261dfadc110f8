"""The start barrier of a fresh run (``hlbp join --wait-replicas N``), on a counter the test controls."""

from __future__ import annotations

import threading
import time

from hlbp.peer.node.replica import wait_for_replicas


def test_returns_once_enough_replicas_are_announced() -> None:
    seen = iter([1, 2, 2, 3, 4, 4])
    lines: list[str] = []
    assert wait_for_replicas(lambda: next(seen), 3, 30.0, threading.Event(), lines.append)
    assert lines == ["waiting for 3 replicas before round 0 (1 announced, at most 30 s)"]


def test_starts_with_whoever_is_there_after_the_timeout() -> None:
    lines: list[str] = []
    t0 = time.monotonic()
    assert not wait_for_replicas(lambda: 2, 4, 0.2, threading.Event(), lines.append)
    assert time.monotonic() - t0 < 5.0
    assert lines[-1] == "starting with 2 of 4 replicas: the others were not announced within 0.2 s"


def test_already_enough_or_stopped_returns_at_once() -> None:
    lines: list[str] = []
    assert wait_for_replicas(lambda: 5, 4, 30.0, threading.Event(), lines.append) and not lines
    stop = threading.Event()
    stop.set()
    assert not wait_for_replicas(lambda: 1, 4, 30.0, stop, lines.append)
