"""Which stage peers a driver's micro-batches go through: the chain in use, the peers it banned for failing, and
the throughput it measured of each.

The rules are pure (:mod:`hlbp.peer.swarm.routing`: the backoff, the least expected finish time, the sticky
choice); :class:`Chains` holds the driver's state for them and waits, with the clock, for a chain to appear.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from hlbp.peer.swarm.routing import Bans, Candidate, ShareCosts, assign_routes, choose_chain, choose_serving

logger = logging.getLogger(__name__)

CandidatesFn = Callable[[], Sequence[Sequence[Candidate]]]
T = TypeVar("T")

ENDS_KEPT = 9  # ends of shared steps whose median the sharing judgement uses
RATES_KEPT = 9  # a stage peer's latest micro-batch rates; its measured throughput is their median
RATES_NEEDED = 3  # rates a peer is measured from at least: one pass slowed by a busy core cannot set a median of 3


class Chains:
    """The driver's choice of chain. ``candidates()`` lists the announced peers of stages 1..S-1 (from the DHT),
    at the throughput they announce in full-model tokens/s; ``wait_s``: how long :meth:`choose` waits for a complete
    chain; ``stop``: an event that ends the wait. ``shares[i]``: stage i+1's fraction of the model's compute per
    token (:func:`~hlbp.peer.model.decoder.compute_shares`), which turns the rate a stage peer is measured at (its
    stage's tokens/s) into the announcements' unit; without it a measured rate reads several times an announced
    one and a switch compares the two wrongly. ``grad_bytes[i]``: the bytes of stage i+1's gradient; with it, several
    peers serve a stage only where the step gains more than their trade costs
    (:func:`~hlbp.peer.swarm.routing.fewest_that_pay`)."""

    def __init__(self, candidates: CandidatesFn, wait_s: float, stop: Any = None,
                 shares: Sequence[float] = (), grad_bytes: Sequence[int] = ()) -> None:
        self.candidates, self.wait_s, self.stop = candidates, wait_s, stop
        self.shares = tuple(shares)
        self.grad_bytes = tuple(grad_bytes)
        self.ends: deque[float] = deque(maxlen=ENDS_KEPT)  # what the latest ends of shared steps took
        self.chain: list[str] = []  # the chain in use (empty before the first step): the first serving peer of each
        self.serving: list[list[str]] = []  # the peers that served each stage in the last step, sorted by id
        self.bans = Bans()
        self.measured: dict[str, float] = {}  # tokens/s of its stage per stage peer, from the busy times it reports
        self._rates: dict[str, deque[float]] = {}  # the latest per micro-batch, after each peer's first

    def options(self, calibrated: bool = False) -> list[list[Candidate]]:
        """Each stage's announced peers, at the throughput measured where there is one (in full-model tokens/s).

        ``calibrated`` (the choice of several peers per stage): where a stage's measured peers do more than they
        announced, its peers not measured yet are believed that much faster too (the median ratio). A probe runs
        once at a peer's start, often beside other work, and reads low: compared raw with a measured rate, an
        honest peer of a stage looks slow and is never given the stage's work that would measure it. The ratio is
        never taken below 1: a peer announcing far more than it does must not make every other peer of its stage
        look slow and so keep the stage."""
        out = []
        for i, stage in enumerate(self.candidates()):
            rated = [Candidate(c.peer, self._rate(i, c), bandwidth=c.bandwidth) for c in stage]
            seen = [r.throughput / c.throughput for c, r in zip(stage, rated, strict=True)
                    if self.measured.get(c.peer) and c.throughput > 0]
            k = max(1.0, statistics.median(seen)) if calibrated and seen else 1.0
            out.append([r if self.measured.get(r.peer) else replace(r, throughput=r.throughput * k) for r in rated])
        return out

    def _rate(self, i: int, c: Candidate) -> float:
        rate = self.measured.get(c.peer)
        if not rate:
            return c.throughput
        return rate * (self.shares[i] if i < len(self.shares) else 1.0)

    def available(self, tokens: int = 1) -> bool:
        """Whether a complete chain of unbanned stage peers is announced now (no waiting)."""
        return choose_chain(self.options(), self.chain, self.bans, time.monotonic(), tokens) is not None

    def choose(self, tokens: int, give_up: Callable[[], bool] | None = None, me: str = "",
               switch_factor: float = 0.0) -> list[str] | None:
        """The chain for the next micro-batches of ``tokens`` tokens; waits up to ``wait_s`` for one (or until
        ``give_up()`` or the stop event). ``me``: the driver's peer id, for the log. ``switch_factor`` > 0 (a
        phase's first step): a serving peer gives way to one at least that many times faster
        (:func:`~hlbp.peer.swarm.routing.choose_chain`)."""

        def attempt(options: list[list[Candidate]]) -> list[str] | None:
            chain = choose_chain(options, self.chain, self.bans, time.monotonic(), tokens, switch_factor)
            if chain is not None:
                if chain != self.chain:
                    logger.info("pipeline chain: %s", " -> ".join(p[:12] for p in [me, *chain]))
                    self._log_faster(options, chain)
                self.chain = chain
                if [stage[0] for stage in self.serving] != chain:  # a new chain: its peers alone serve
                    self.serving = [[p] for p in chain]
            return chain

        return self._wait(attempt, give_up)

    def pick(self, tokens: Sequence[int], give_up: Callable[[], bool] | None = None, me: str = "", most: int = 1,
             fresh: bool = False, switch_factor: float = 0.0) -> list[list[str]] | None:
        """The peers that serve each stage in a step of micro-batches of ``tokens`` tokens, at most ``most`` each
        (:func:`~hlbp.peer.swarm.routing.choose_serving`; ``fresh``: the phase's first step); waits as
        :meth:`choose` does. The chain in use becomes the first peer of each stage."""
        if most <= 1:
            chain = self.choose(max(tokens, default=1), give_up, me, switch_factor if fresh else 0.0)
            self.serving = [] if chain is None else [[p] for p in chain]
            return None if chain is None else self.serving

        def attempt(options: list[list[Candidate]]) -> list[list[str]] | None:
            end_s = statistics.median(self.ends) if self.ends else 0.0
            costs = ShareCosts(self.grad_bytes, self.shares, end_s) if self.grad_bytes else None
            serving = choose_serving(options, self.serving, self.bans, time.monotonic(), tokens, most, fresh,
                                     switch_factor if fresh else 0.0, costs)
            if serving is not None:
                if serving != self.serving:
                    logger.info("pipeline stages served by: %s", " -> ".join(
                        "+".join(p[:12] for p in stage) for stage in [[me], *serving]))
                    self._log_faster(options, [stage[0] for stage in serving])
                self.serving, self.chain = serving, [stage[0] for stage in serving]
            return serving

        return self._wait(attempt, give_up, calibrated=True)

    def shared_end(self, seconds: float) -> None:
        """The end of a shared step (its finish down the chain, the trades, its done back up) took ``seconds``. The
        median of the latest is what sharing is judged by: a first end that dialled the stage's peers, or one that
        met a busy moment, does not stop a stage from being shared for good."""
        self.ends.append(seconds)

    def _wait(self, attempt: Callable[[list[list[Candidate]]], T | None],
              give_up: Callable[[], bool] | None, calibrated: bool = False) -> T | None:
        """``attempt(options)`` every half second until it returns something, for at most ``wait_s`` (or until
        ``give_up()`` or the stop event); None if it never did. ``calibrated``: see :meth:`options`."""
        deadline = time.monotonic() + self.wait_s
        announced_once = False
        while True:
            options = self.options(calibrated)
            found = attempt(options)
            if found is not None:
                return found
            if time.monotonic() >= deadline or (self.stop is not None and self.stop.is_set()) \
                    or (give_up is not None and give_up()):
                return None
            if not announced_once:
                missing = [i + 1 for i, o in enumerate(options) if not o]
                logger.info("waiting for stage peers (stages without a usable peer: %s)", missing or "banned")
                announced_once = True
            time.sleep(0.5)

    def routes(self, serving: Sequence[Sequence[str]], tokens: Sequence[int],
               keep: Sequence[Sequence[str]] = ()) -> list[list[str]]:
        """Each micro-batch's route through ``serving`` by least expected finish at the rates believed now
        (:func:`~hlbp.peer.swarm.routing.assign_routes`; ``keep``: routes of a re-run).

        A serving peer never measured, beside one that was, is taken at the median of the measured ones: its
        announcement (a probe run once, on another load) and a measured rate are not comparable, and compared raw
        one of them would get most of the step and the other stay unmeasured. An equal part measures it."""
        rate = {c.peer: c.throughput for stage in self.options() for c in stage}

        def believed(stage: Sequence[str]) -> list[Candidate]:
            known = [rate[p] for p in stage if self.measured.get(p) and p in rate]
            fill = statistics.median(known) if known else None
            return [Candidate(p, rate.get(p, 1.0) if fill is None or self.measured.get(p) else fill) for p in stage]

        return assign_routes(tokens, [believed(stage) for stage in serving], keep)

    def _log_faster(self, options: Sequence[Sequence[Candidate]], chain: Sequence[str]) -> None:
        """Log each stage whose serving peer, neither banned nor gone, gave way to a faster one, with each one's
        rate in full-model tokens/s and whether it was measured or only announced (a stale announcement is what a
        misjudged switch comes from)."""
        now = time.monotonic()
        rate = {c.peer: c.throughput for stage in options for c in stage}

        def said(peer: str) -> str:
            return f"{rate[peer]:.0f} full-model tokens/s, {'measured' if self.measured.get(peer) else 'announced'}"

        for i, (old, new) in enumerate(zip(self.chain, chain)):
            if old != new and old in rate and not self.bans.banned(old, now):
                logger.warning("stage %d: %s (%s) takes over from %s (%s), a standby again",
                               i + 1, new[:12], said(new), old[:12], said(old))

    def live(self) -> list[str]:
        """The peers of the chain in use, and those serving a stage beside it, that are not banned now."""
        now = time.monotonic()
        peers = [p for stage in self.serving for p in stage] if self.serving else self.chain
        return [p for p in peers if not self.bans.banned(p, now)]

    def fail(self, peer: str) -> float:
        """Ban ``peer`` for failing (backoff); returns for how many seconds."""
        return self.bans.fail(peer, time.monotonic())

    def served(self, peers: Sequence[str]) -> None:
        """``peers`` served a whole step: their failures are forgiven."""
        for p in peers:
            self.bans.ok(p)

    def measure(self, peer: str, rate: float) -> None:
        """A micro-batch's throughput of ``peer`` (tokens/s), from the busy time it reported. Its measured rate is
        the median of its latest :data:`RATES_KEPT`, its first micro-batch left out: that one pays the peer's
        warm-up (first allocations and kernels, four times the CPU of the next), and one slow pass (a warm-up, a
        pause, a busy core) must not steer routing for steps. A rate read too low routes less to the peer, which is
        then measured less often: with a moving average seeded by the warm-up pass, two peers of a stage split a
        step 3:1 for its first four steps, and a peer read at its warm-up among peers read warm was dropped from
        its stage. A peer counts as not measured (see :meth:`options`) until :data:`RATES_NEEDED` rates after its
        first: the busy time is wall time, and one pass preempted on a loaded core read a peer of a shared stage
        four times slower than its mate, so the next step routed it nothing and it fell out of its stage's phase."""
        kept = self._rates.get(peer)
        if kept is None:
            self._rates[peer] = deque(maxlen=RATES_KEPT)
            return
        kept.append(rate)
        if len(kept) >= RATES_NEEDED:
            self.measured[peer] = statistics.median(kept)
