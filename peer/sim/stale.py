"""Inner steps with a stale gradient, in process: what an asynchronous pipeline schedule would cost in loss.

A synchronous pipeline step waits for its last micro-batch to come back before any stage steps, and the next step
cannot start before that (the fill and drain of every step, docs/design.md). An asynchronous schedule starts the
next step's micro-batches while the previous step's gradient is still on its way: its gradient is then taken at
the weights from before the previous update (PipeDream-2BW's one-step delay), and applied to the current ones. A
weight look-ahead (as in SWARM's successors and Pluralis's asynchronous pipeline) takes that gradient at a guess of
the current weights instead: the last weights pushed on by the last update, ``w_prev + (w_prev - w_prev_prev)``.

:class:`StaleSteps` runs a trainer's steps that way; :class:`StaleReplica` is a full replica whose inner phase does
(the first step of a phase is fresh: a round's end drains the pipeline). ``hlbp bench convergence --stale``
compares them with fresh steps at equal tokens. Nothing here runs in a peer.
"""

from __future__ import annotations

from enum import Enum

import torch

from hlbp.peer.sim.engine import FullReplica
from hlbp.peer.train.trainer import InnerTrainer


class Staleness(Enum):
    """Where a step's gradient is taken."""

    FRESH = "fresh"  # at the weights it steps (a synchronous schedule)
    STALE = "stale"  # at the weights from before the previous step (one-step delay)
    LOOKAHEAD = "lookahead"  # at the stale weights pushed on by the previous step's change (a look-ahead)


class StaleSteps:
    """A trainer's steps with their gradient taken as ``mode`` says; :meth:`drain` makes the next one fresh."""

    def __init__(self, trainer: InnerTrainer, mode: Staleness) -> None:
        self.trainer, self.mode = trainer, mode
        self._older: dict[str, torch.Tensor] | None = None  # the weights before the previous step
        self._oldest: dict[str, torch.Tensor] | None = None  # and before the one ahead of it

    def drain(self) -> None:
        """The pipeline emptied (a round's end): the next step's gradient is taken at the current weights."""
        self._older = self._oldest = None

    def _grad_at(self) -> dict[str, torch.Tensor] | None:
        if self.mode is Staleness.FRESH or self._older is None:
            return None
        if self.mode is Staleness.LOOKAHEAD and self._oldest is not None:
            return {n: 2 * w - self._oldest[n] for n, w in self._older.items()}
        return self._older

    def step(self) -> float:
        """One optimizer step; returns its training loss."""
        before = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}
        loss = self.trainer.train_step(grad_at=self._grad_at())
        self._oldest, self._older = self._older, before
        return loss


class StaleReplica:
    """A full replica whose inner phase steps as :class:`StaleSteps` says, drained at every phase's start (the
    simulation's :class:`~hlbp.peer.sim.engine.EngineReplica`)."""

    def __init__(self, replica: FullReplica, mode: Staleness) -> None:
        self.replica, self.name = replica, replica.name
        self.steps = StaleSteps(replica.trainer, mode)

    @property
    def tokens(self) -> int:
        return self.replica.tokens

    def params(self) -> dict[str, torch.Tensor]:
        return self.replica.params()

    def load_params(self, params: dict[str, torch.Tensor]) -> None:
        self.replica.load_params(params)

    def train(self, steps: int) -> float:
        self.steps.drain()
        return sum(self.steps.step() for _ in range(steps)) / max(1, steps)
