"""Pure routing state of a pipeline driver: who serves each stage, who is banned, and how long to wait.

- :class:`Bans`: a failed peer is skipped for ``base_s * 2**(failures-1)`` seconds, capped (Petals' rule), and
  forgiven after it served a whole step.
- :class:`LatencyTracker`: the deadline of a micro-batch is ``factor`` times the recent p95 of measured round
  trips, within bounds; an explicit value overrides it.
- :func:`choose_chain`: one peer per stage by least expected finish time (queued tokens over measured throughput,
  SWARM's rule), sticky: the peer that served the stage last keeps it while it is not banned, because a switch
  mid-phase costs the stage its inner progress (a standby holds only the round's result). At a phase's first step
  a switch costs only the stage's AdamW moments, so there a peer at least ``switch_factor`` times faster takes the
  stage: a slow peer that came first is a standby again, not a drag on its swarm for the rest of the run.
- :func:`choose_serving` and :func:`assign_routes`: several peers serving one stage in a step (they trade gradients
  at its end, :mod:`hlbp.peer.swarm.siblings`): who serves, and which micro-batch goes through which of them.

Nothing here touches the network or the clock: time comes in as arguments, so each rule is a unit test.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Bans:
    """Exponential backoff per peer: ``base_s``, doubling per consecutive failure, at most ``max_s``."""

    base_s: float = 5.0
    max_s: float = 300.0
    failures: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)

    def fail(self, peer: str, now: float) -> float:
        """Record a failure of ``peer``; returns how long it is banned."""
        n = self.failures.get(peer, 0) + 1
        self.failures[peer] = n
        seconds = min(self.max_s, self.base_s * 2 ** (n - 1))
        self.until[peer] = now + seconds
        return seconds

    def ok(self, peer: str) -> None:
        """``peer`` served a whole step: its failure count starts over."""
        self.failures.pop(peer, None)
        self.until.pop(peer, None)

    def banned(self, peer: str, now: float) -> bool:
        return self.until.get(peer, 0.0) > now


@dataclass
class LatencyTracker:
    """Recent round-trip times of micro-batches and the deadline they imply."""

    factor: float = 3.0
    min_s: float = 5.0
    max_s: float = 120.0
    override_s: float | None = None  # a fixed deadline from the user
    window: int = 64
    samples: deque[float] = field(default_factory=deque)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        while len(self.samples) > self.window:
            self.samples.popleft()

    def p95(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def deadline(self) -> float:
        """Seconds a micro-batch may take before the driver looks for the stage that failed."""
        if self.override_s is not None:
            return self.override_s
        p95 = self.p95()
        if p95 is None:
            return self.max_s  # nothing measured yet: the first micro-batches pay for warm-up and connections
        return min(self.max_s, max(self.min_s, self.factor * p95))


@dataclass(frozen=True)
class Candidate:
    """A peer announced for a stage, with the driver's view of it."""

    peer: str
    throughput: float  # tokens/s: measured by the driver when it has served, else announced
    queued_tokens: int = 0  # tokens the driver has in flight on this peer
    bandwidth: float = 0.0  # bytes/s it announces it can download (0: unknown)


@dataclass(frozen=True)
class ShareCosts:
    """What lets the driver weigh several peers on a stage against their trade: ``grad_bytes[i]``, the bytes of
    stage i's gradient (what each of its peers sends every other one at a step's end), and ``shares[i]``, its
    fraction of the model's compute per token (a candidate's full-model tokens/s over it is the stage's rate)."""

    grad_bytes: Sequence[int]
    shares: Sequence[float]
    end_s: float = 0.0  # what the end of a shared step took lately (measured; it adds a chain round trip)

    def work_s(self, i: int, peers: Sequence[Candidate], tokens: Sequence[int]) -> float:
        """Seconds stage i's slowest peer of ``peers`` computes over a step of micro-batches of ``tokens`` tokens,
        routed by :func:`assign_routes`."""
        load = {c.peer: 0 for c in peers}
        for t, route in zip(tokens, assign_routes(tokens, [peers]), strict=True):
            load[route[0]] += t
        share = self.shares[i] if i < len(self.shares) else 1.0
        return max(load[c.peer] * share / max(c.throughput, 1e-9) for c in peers)

    def trade_s(self, i: int, peers: Sequence[Candidate]) -> float:
        """Seconds the trade of stage i's gradient between ``peers`` takes at their announced bandwidth: each one
        downloads every other one's part (infinite where one announces none; nothing for a lone peer)."""
        if len(peers) <= 1:
            return 0.0
        slowest = min(c.bandwidth for c in peers)
        size = self.grad_bytes[i] if i < len(self.grad_bytes) else 0
        return math.inf if slowest <= 0 else (len(peers) - 1) * size / slowest


def expected_finish(c: Candidate, tokens: int) -> float:
    """Seconds until ``c`` would finish ``tokens`` more after what is queued on it."""
    return (c.queued_tokens + tokens) / max(c.throughput, 1e-9)


def choose_chain(
    candidates: Sequence[Sequence[Candidate]],
    current: Sequence[str | None],
    bans: Bans,
    now: float,
    tokens: int,
    switch_factor: float = 0.0,
) -> list[str] | None:
    """One peer per stage (index 0 is the first stage after the driver), or None if some stage has no usable
    peer. ``current[i]`` keeps stage i while it is a candidate and not banned, unless ``switch_factor`` > 0 and the
    best usable peer's throughput is at least that many times the kept one's; otherwise the least expected
    finish time wins, ties broken by peer id so every run decides the same way."""
    chain = []
    for i, options in enumerate(candidates):
        usable = [c for c in options if not bans.banned(c.peer, now)]
        if not usable:
            return None
        best = min(usable, key=lambda c: (expected_finish(c, tokens), c.peer))
        held = current[i] if i < len(current) else None
        keep = next((c for c in usable if c.peer == held), None)
        faster = switch_factor > 0 and keep is not None and best.throughput >= switch_factor * keep.throughput
        chain.append(keep.peer if keep is not None and not faster else best.peer)
    return chain


def assign_routes(tokens: Sequence[int], serving: Sequence[Sequence[Candidate]],
                  keep: Sequence[Sequence[str]] = ()) -> list[list[str]]:
    """The route of each micro-batch of a step (micro-batch i has ``tokens[i]`` tokens): at every stage, the peer of
    ``serving[s]`` that would finish it first, counting what the step's earlier micro-batches already put on each
    (SWARM's least expected finish time). Ties go to the lower peer id, so the same view routes the same way.

    ``keep[i]``: micro-batch i's route so far (a re-run after a failure). Where its peer of a stage still serves,
    it stays there: that peer has accumulated the micro-batch's gradient, and a second peer of the stage
    accumulating it too would count it twice in their trade."""
    routes: list[list[str]] = [[] for _ in tokens]
    for s, options in enumerate(serving):
        if not options:
            raise ValueError("a stage without a serving peer")
        queued = {c.peer: c.queued_tokens for c in options}
        held = [keep[i][s] if i < len(keep) and s < len(keep[i]) and keep[i][s] in queued else None
                for i in range(len(tokens))]
        for i, t in enumerate(tokens):
            if held[i] is not None:
                queued[held[i]] += t
        for i, t in enumerate(tokens):
            best = held[i] or min(options, key=lambda c: ((queued[c.peer] + t) / max(c.throughput, 1e-9),
                                                          c.peer)).peer
            if held[i] is None:
                queued[best] += t
            routes[i].append(best)
    return routes


def choose_serving(
    candidates: Sequence[Sequence[Candidate]],
    current: Sequence[Sequence[str]],
    bans: Bans,
    now: float,
    tokens: Sequence[int],
    most: int,
    fresh: bool,
    switch_factor: float = 0.0,
    costs: ShareCosts | None = None,
) -> list[list[str]] | None:
    """The peers that serve each stage in a step of micro-batches of ``tokens`` tokens, at most ``most`` per stage
    (sorted by id), or None if some stage has no usable peer.

    Peers that serve one stage together keep equal weights by summing their gradients each step, so a peer may
    join them only where every peer of the stage holds the same weights: at a phase's first step (``fresh``), where
    all of them start from the round's result. There the ``most`` fastest usable peers are chosen and those that
    :func:`assign_routes` would give no micro-batch are left out (a peer so slow that it would only make the others
    wait for its share). Within a phase a stage keeps the peers of ``current`` that are still usable; a stage left
    without one takes the single best (:func:`choose_chain`: its lone peer starts from its own weights, as a
    replacement always has). ``most`` 1 is :func:`choose_chain` with its sticky choice and ``switch_factor``.

    With ``costs``, a phase's first step also weighs each added peer against its trade
    (:func:`fewest_that_pay`): a stage takes fewer than ``most`` where the trade would cost the step more than the
    added peers save it, so on slow links a stage is served by one peer, chosen as with ``most`` 1."""
    if most <= 1:
        held = [stage[0] if stage else None for stage in current]
        chain = choose_chain(candidates, held, bans, now, max(tokens, default=1), switch_factor if fresh else 0.0)
        return None if chain is None else [[p] for p in chain]
    pools: list[list[Candidate]] = []
    for i, options in enumerate(candidates):
        usable = [c for c in options if not bans.banned(c.peer, now)]
        if not usable:
            return None
        kept = [] if fresh else [c for c in usable if i < len(current) and c.peer in current[i]]
        if not kept:
            pool = usable if fresh else [min(usable, key=lambda c: (expected_finish(c, max(tokens, default=1)),
                                                                     c.peer))]
            kept = sorted(pool, key=lambda c: (-c.throughput, c.peer))[:most]
        pools.append(kept)
    if fresh and costs is not None and tokens:
        counts = fewest_that_pay(pools, tokens, costs)
        pools = [pool[:k] if k > 1 else _lone(candidates[i], current[i] if i < len(current) else (), bans, now,
                                              max(tokens), switch_factor)
                 for i, (pool, k) in enumerate(zip(pools, counts, strict=True))]
    serving = []
    for kept in pools:
        used = {peer for route in assign_routes(tokens, [kept]) for peer in route} if tokens else {kept[0].peer}
        serving.append(sorted(c.peer for c in kept if c.peer in used))
    return serving


def _lone(options: Sequence[Candidate], current: Sequence[str], bans: Bans, now: float, tokens: int,
          switch_factor: float) -> list[Candidate]:
    """The one peer of a stage that sharing would not pay for, chosen as without sharing (:func:`choose_chain`): the
    peer that served it keeps it unless one ``switch_factor`` times faster is usable, so two peers of about the same
    speed do not hand the stage back and forth, and its AdamW moments, at every phase's start."""
    chain = choose_chain([options], [current[0] if current else None], bans, now, tokens, switch_factor)
    peer = chain[0] if chain else None
    return [c for c in options if c.peer == peer]


def fewest_that_pay(pools: Sequence[Sequence[Candidate]], tokens: Sequence[int], costs: ShareCosts) -> list[int]:
    """How many of each stage's ``pools[i]`` (fastest first) serve a step of micro-batches of ``tokens`` tokens.

    A step takes about its slowest stage's work (the micro-batches stream through the others meanwhile) plus, when
    a stage is shared, the step's end: the shared stages' trades (at the announced bandwidth), or what shared ends
    took lately where the driver measured more (``costs.end_s``: it adds the finish's round trip down the chain).
    Starting from one peer a stage, the single change of one stage's count that shortens that estimate most is
    made, again and again, while one shortens it by more than 1 %: so a stage that is not the bottleneck is not
    shared (its trade would only add time), and one whose trade crosses a slow link keeps a single peer. The
    driver's own stage is not counted."""
    counts = [1] * len(pools)

    def estimate(ks: Sequence[int]) -> float:
        pairs = list(enumerate(zip(pools, ks, strict=True)))
        work = max(costs.work_s(i, pool[:k], tokens) for i, (pool, k) in pairs)
        trades = sum(costs.trade_s(i, pool[:k]) for i, (pool, k) in pairs)
        return work + (max(trades, costs.end_s) if any(k > 1 for k in ks) else 0.0)

    best = estimate(counts)
    while True:
        options = [[*counts[:i], k, *counts[i + 1:]] for i, pool in enumerate(pools)
                   for k in range(1, len(pool) + 1) if k != counts[i]]
        scored = min(((estimate(ks), ks) for ks in options), default=None)
        if scored is None or scored[0] >= 0.99 * best:
            return counts
        best, counts = scored


def throughput_of(peer: str, measured: Mapping[str, float], announced: Mapping[str, float]) -> float:
    """What the driver believes of ``peer``: its measured tokens/s, else what it announced, else 1."""
    return measured.get(peer) or announced.get(peer) or 1.0
