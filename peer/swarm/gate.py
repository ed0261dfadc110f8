"""Where a stage peer's inner steps meet its outer rounds: parameters change only between two steps.

A stage server computes on its compute thread, one step after another, as the driver sends them; its round loop
(hlbp.peer.node.stagerounds) runs on another thread and, once per round, replaces the stage's parameters with the
round's result. The two meet here:

- the compute thread calls :meth:`RoundGate.enter` before it starts a step's first micro-batch (it waits while a
  round is being exchanged) and :meth:`RoundGate.leave` when the step is applied or dropped, with the step's tokens
  and whether the driver marked it as the last step of the round;
- that mark closes the gate at once, on the compute thread, so no step of the next round can start before the
  round loop has taken the step count (:meth:`take`), exchanged and loaded the result, and called :meth:`open`;
- when the round closes without the swarm (its driver is gone, or behind), the round loop closes the gate itself
  between two steps (:meth:`close_between_steps`), waiting a bounded time for a step under way to end;
- the gate also knows the round whose inner phase the loaded parameters start (:meth:`open` is told it), and a
  step of a later round waits as at a closed gate. A peer that was not in the swarm's last round (a standby that
  takes over mid-run, a joiner) gets no end-of-round mark, so its gate is open while its round loop still has to
  take the round's result: served then, the step would run on the last round's parameters, work an auditor
  rightly finds stale (hlbp.peer.swarm.audit). Only the next round waits so: a claim of a round further ahead,
  which no round loop reaches by waiting, is served at once, so a driver cannot hold a stage's compute thread
  with a made-up round number.

Why a gate and not a lock: a step spans many jobs (forwards, backwards, finish, apply) and arrives from the
network; a step's stored graphs hold the parameters it was computed with, so changing them mid-step would make
its backward raise. The gate holds no lock across those jobs, only a flag and a condition.
"""

from __future__ import annotations

import threading
import time


class RoundGate:
    """The flag and the counters between a stage's compute thread and its round loop (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.in_step = False
        self.closed = False
        self.ended = False  # the driver marked a step as the round's last one
        self.steps = 0  # steps applied since the last take()
        self.tokens = 0
        self._entered_at = 0.0
        self.round: int | None = None  # the round whose phase the loaded parameters start (None: not told)

    def ready_for(self, round_: int | None) -> bool:
        """Whether a step of round ``round_`` (None: any round) may start now: the gate is open and the loaded
        parameters are not those of the round before (see the module docstring)."""
        with self._cond:
            return self._ready(round_)

    def _ready(self, round_: int | None) -> bool:
        return not self.closed and (round_ is None or self.round is None or round_ != self.round + 1)

    def enter(self, timeout: float, round_: int | None = None) -> bool:
        """Compute thread, before a step's first micro-batch of round ``round_``: wait while the gate is closed or
        the parameters are an earlier round's (at most ``timeout`` seconds, after which the step goes ahead: a
        stuck round loop must not stop the swarm for ever). Returns whether the gate was ready in time."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._ready(round_), timeout)
            self.in_step = True
            self._entered_at = time.monotonic()
            return ok

    def leave(self, applied: bool, tokens: int = 0, round_end: bool = False, round_: int | None = None) -> None:
        """Compute thread, after a step of round ``round_`` (None: not said) was applied (or dropped: ``applied``
        False). ``round_end`` closes the gate: the next step waits for the round's result. A step of another round
        than the loaded parameters' (a driver a round behind this peer, which synced past it) is neither counted
        in this phase nor ends it: its mark would end the phase before the swarm's steps of this round ran."""
        with self._cond:
            self.in_step = False
            ours = round_ is None or self.round is None or round_ == self.round
            if applied and ours:
                self.steps += 1
                self.tokens += tokens
            if round_end and ours:
                self.ended = self.closed = True
            self._cond.notify_all()

    def wait_ended(self, timeout: float) -> bool:
        """Round loop: wait up to ``timeout`` for the driver's end-of-round mark; returns whether it came."""
        with self._cond:
            return self._cond.wait_for(lambda: self.ended, timeout)

    def close_between_steps(self, timeout: float) -> bool:
        """Round loop: close the gate as soon as no step is under way. A step that has not ended after
        ``timeout`` seconds is taken as dead (its driver left mid-step): the gate closes anyway and the
        caller drops that step's state. Returns whether the gate closed between steps."""
        with self._cond:
            clean = self._cond.wait_for(lambda: not self.in_step, timeout)
            self.closed = True
            return clean

    def take(self) -> tuple[int, int]:
        """Round loop, gate closed: the steps and tokens of the inner phase that just ended, and a fresh count."""
        with self._cond:
            out = (self.steps, self.tokens)
            self.steps = self.tokens = 0
            self.ended = False
            return out

    def open(self, round_: int | None = None) -> None:
        """Round loop: the round's result is loaded, the parameters start round ``round_`` (None: unchanged);
        steps may start again."""
        with self._cond:
            self.closed = False
            if round_ is not None:
                self.round = round_
            self._cond.notify_all()
