"""The auditor asks once more for a blob whose fetch failed fast (a stream broken on a loaded box), never for one
that timed out (a peer that does not answer would spend the round's audit budget twice as fast)."""

from __future__ import annotations

import time

import pytest

from hlbp.peer.net.transport import TransportError
from hlbp.peer.swarm.auditor import fetch_again_if_fast


class Scripted:
    """A fetch that fails the first ``fails`` calls, each after ``delay`` seconds, then answers."""

    def __init__(self, fails: int, delay: float) -> None:
        self.fails, self.delay, self.calls = fails, delay, 0

    def __call__(self, peer: str, name: str, max_size: int, timeout: float) -> bytes:
        self.calls += 1
        if self.calls <= self.fails:
            time.sleep(self.delay)
            raise TransportError(f"{name} from {peer}: stream reset")
        return f"{name} from {peer}".encode()


def test_a_fast_failure_is_asked_again_once() -> None:
    fetch = Scripted(fails=1, delay=0.0)
    assert fetch_again_if_fast(fetch, "p", "audit/i/3", 64, 1.0) == b"audit/i/3 from p" and fetch.calls == 2
    twice = Scripted(fails=2, delay=0.0)
    with pytest.raises(TransportError):
        fetch_again_if_fast(twice, "p", "audit/i/3", 64, 1.0)
    assert twice.calls == 2


def test_a_failure_that_took_over_half_the_timeout_is_not_asked_again() -> None:
    slow = Scripted(fails=1, delay=0.6)
    with pytest.raises(TransportError):
        fetch_again_if_fast(slow, "p", "audit/i/3", 64, 1.0)
    assert slow.calls == 1
