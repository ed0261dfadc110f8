"""Stage 0's side of a swarm's inner phase."""

from __future__ import annotations

import time
from collections.abc import Callable


def sticky_every(check: Callable[[], bool], seconds: float) -> Callable[[], bool]:
    """``check()`` asked at most every ``seconds`` (a DHT read each time), and True for good once it was True."""
    state = {"at": 0.0, "value": False}

    def ask() -> bool:
        if not state["value"] and time.monotonic() - state["at"] >= seconds:
            state["value"], state["at"] = bool(check()), time.monotonic()
        return state["value"]
    return ask
