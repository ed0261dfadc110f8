"""Turns between a peer's training steps and the forward passes its round exchange runs beside them.

Under eager overlap a full replica's round exchange runs in a thread of its own while the next phase trains. That
thread scores the round's candidate on the guard batch and, when the peer coordinates, recomputes stage peers'
frames for the audits: forward passes whose activations (and the audits' backward) came on top of a training step's
own, at its peak (its activations, then its gradients). Measured on the small model, that meeting cost about
2 bytes per trained parameter of peak host memory over a run whose exchange never runs beside a step (docs/design.md,
"Memory per parameter"). :class:`Turns` keeps the two apart: a training step runs whole in its turn, and a side
computation waits for the step under way to end; the trainer lets a waiting side computation go first, so the
exchange is never starved by steps that follow one another.

What it costs: a side computation no longer runs on another core beside a step, so the phase waits for it (one
guard pass a round, and a coordinator's audit samples). Nothing else of the exchange (fetching, decoding, applying)
takes a turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext


class Turns:
    """One training step or one side computation at a time; a waiting side computation goes before the next step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._asking = 0  # side computations waiting for a turn
        self.step_wait_s = 0.0  # seconds training steps waited for side computations: what the turns cost

    @property
    def waiting(self) -> int:
        """Side computations waiting for their turn now."""
        return self._asking

    @contextmanager
    def step(self) -> Iterator[None]:
        """A training step's turn: after every side computation that is waiting."""
        start = time.perf_counter()
        with self._cond:
            while self._held or self._asking:
                self._cond.wait()
            self._held = True
        self.step_wait_s += time.perf_counter() - start
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """A side computation's turn: once the step under way (if any) has ended."""
        with self._cond:
            self._asking += 1
            try:
                while self._held:
                    self._cond.wait()
            finally:
                self._asking -= 1
            self._held = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


def side_turn(turns: Turns | None) -> AbstractContextManager[None]:
    """A side computation's turn of ``turns``, or nothing to wait for where there are no turns (None)."""
    return turns.aside() if turns is not None else nullcontext()
