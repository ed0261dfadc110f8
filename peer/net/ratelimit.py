"""Per-peer rate limits on what a peer may make us do (pushes today): a token bucket per peer, and a ban for one
that keeps flooding. A pure object with an injected clock; the transport consults it before reading a request."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float
    dropped: int = 0  # requests refused since the peer was last within its rate
    banned_until: float = 0.0


class RateLimiter:
    """At most ``rate`` requests a second per peer, ``burst`` at once; a peer with more than ``ban_after`` requests
    refused in a row is refused everything for ``ban_s`` seconds. At most ``max_peers`` peers are tracked (the
    least recently seen is forgotten first), so a crowd of keys cannot grow it without bound."""

    def __init__(self, rate: float, burst: float, ban_after: int = 1000, ban_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_peers: int = 4096) -> None:
        self.rate, self.burst, self.ban_after, self.ban_s = rate, burst, ban_after, ban_s
        self.clock, self.max_peers = clock, max_peers
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0  # requests refused so far, all peers

    def allow(self, peer: str) -> bool:
        """Whether ``peer`` may make one more request now (counted when it may)."""
        now = self.clock()
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = _Bucket(self.burst, now)
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(peer)
        if now < bucket.banned_until:
            self.refused += 1
            return False
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            bucket.dropped = 0
            return True
        bucket.dropped += 1
        self.refused += 1
        if bucket.dropped > self.ban_after:
            bucket.banned_until, bucket.dropped = now + self.ban_s, 0
        return False

    def tracked(self) -> int:
        """How many peers the limiter keeps buckets for."""
        return len(self._buckets)

    def banned(self, peer: str) -> bool:
        """Whether ``peer`` is serving a ban for flooding."""
        bucket = self._buckets.get(peer)
        return bucket is not None and self.clock() < bucket.banned_until
