"""How long a waiter lets a prefetch under way finish before it fetches the payload itself: the fetches' own time,
sized by the payloads, not one timeout whatever their size."""

from __future__ import annotations

import pytest

from hlbp.peer.net.pace import MIN_FETCH_RATE
from hlbp.peer.rounds.payloads import FETCH_SLACK_S, SENDER_TRIES, prefetch_due


def test_a_small_payload_is_waited_for_its_tries_timeouts() -> None:
    assert SENDER_TRIES == 2
    assert prefetch_due(100.0, [0], 30.0, MIN_FETCH_RATE) == 100.0 + 2 * (30.0 + FETCH_SLACK_S)


def test_a_large_payload_gets_its_size_at_the_pace_floor_on_every_try() -> None:
    size = 64 * MIN_FETCH_RATE  # 32 MiB: 64 s at the floor
    assert prefetch_due(0.0, [size], 30.0, MIN_FETCH_RATE) == pytest.approx(2 * (30.0 + 64.0 + FETCH_SLACK_S))


def test_shards_fetched_one_after_another_add_up() -> None:
    one = prefetch_due(0.0, [MIN_FETCH_RATE], 30.0, MIN_FETCH_RATE)
    assert prefetch_due(0.0, [MIN_FETCH_RATE] * 3, 30.0, MIN_FETCH_RATE) == pytest.approx(3 * one)
    assert prefetch_due(0.0, [], 30.0, MIN_FETCH_RATE) == 0.0
