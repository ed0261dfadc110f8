"""Per-peer rate limits: a token bucket each, a ban for a peer that keeps flooding, bounded bookkeeping."""

from __future__ import annotations

from hlbp.peer.net.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate() -> None:
    clock = Clock()
    limit = RateLimiter(rate=10.0, burst=5.0, clock=clock)
    assert [limit.allow("p") for _ in range(7)] == [True] * 5 + [False] * 2
    assert limit.allow("q")  # another peer has its own bucket
    clock.now = 0.3  # 3 tokens back
    assert [limit.allow("p") for _ in range(4)] == [True] * 3 + [False]
    assert limit.refused == 3


def test_a_flooding_peer_is_banned_for_a_while_then_let_back() -> None:
    clock = Clock()
    limit = RateLimiter(rate=10.0, burst=2.0, ban_after=50, ban_s=60.0, clock=clock)
    for _ in range(53):  # 2 allowed, 51 refused: past the threshold
        limit.allow("flood")
    assert limit.banned("flood")
    clock.now = 30.0
    assert not limit.allow("flood")  # tokens are back, but the ban holds
    clock.now = 61.0
    assert limit.allow("flood") and not limit.banned("flood")


def test_bookkeeping_is_bounded_by_the_peers_tracked() -> None:
    limit = RateLimiter(rate=1.0, burst=1.0, clock=Clock(), max_peers=100)
    for i in range(1000):
        limit.allow(f"key{i}")
    assert limit.tracked() == 100
