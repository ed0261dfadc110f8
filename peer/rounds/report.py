"""The per-round report of a round loop: the new parameters scored, one metrics record, and the caller told."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hlbp.peer.common import memory
from hlbp.peer.rounds.config import RoundStats
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.protocol.roundwire import ShardChecks


@dataclass(frozen=True)
class Scored:
    """A round's validation loss taken before its report was written (None: not scored)."""

    loss: float | None


class RoundReporter:
    """Reports each round: ``evaluate(params)`` scores parameters (None: not scored), ``metrics`` takes the round's
    record (event ``round``), ``on_round(stats, val_loss)`` tells the caller. Each record carries the process's
    memory (:func:`hlbp.peer.common.memory.snapshot`) and the parameters the peer trains (``trained``), whose
    quotient is the memory budget ``hlbp bench memory`` reports."""

    def __init__(self, metrics: MetricsLog, evaluate: Callable[[Mapping[str, torch.Tensor]], float | None] | None,
                 on_round: Callable[[RoundStats, float | None], None] | None, trained: int = 0) -> None:
        self.metrics, self.evaluate, self.on_round, self.trained = metrics, evaluate, on_round, trained

    def score(self, params: Mapping[str, torch.Tensor]) -> float | None:
        """The validation loss of ``params`` (the round's new parameters), or None when this peer scores none."""
        return self.evaluate(params) if self.evaluate else None

    def report(self, stats: RoundStats, mine: ShardChecks, steps: int, params: Mapping[str, torch.Tensor],
               scored: Scored | None = None) -> RoundStats:
        """Score ``params`` (the round's new parameters; ``scored``: already scored), write the round's record
        and tell the caller."""
        memory.trim()  # the round's freed buffers (the replaced anchor, its transients) go back to the system
        val = scored.loss if scored is not None else self.score(params)
        extra = {"fingerprints": {str(k): list(v) for k, v in mine.fingerprints.items()}} if mine.fingerprints else {}
        self.metrics.write(event="round", **{k: v for k, v in vars(stats).items() if k != "checksums"},
                           checksums={str(k): v for k, v in mine.checksums.items()}, val_loss=val, steps=steps,
                           trained_params=self.trained, **memory.snapshot(), **extra)
        if self.on_round:
            self.on_round(stats, val)
        return stats
