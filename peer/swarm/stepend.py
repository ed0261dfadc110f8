"""How a stage peer ends a step: what it said about the step under way, and the checks of the step's end against
that (pure, no network).

A step ends one of two ways (:mod:`hlbp.protocol.stagewire`). Usually the backward that completes each stage's
accumulation carries up the squared gradient norm of that stage and every later one, and the driver's ``apply``
comes down with the step's rate and clipping factor. When the norms did not come up complete, the driver sends
``finish`` down, and the last stage's ``done`` comes back up. Either way a stage steps only as the numbers it sent
itself allow: the rate is the schedule's (:func:`~hlbp.peer.swarm.worker.finish_fault`), the total norm is at least
what it counted, and the factor is the one that norm gives (:func:`~hlbp.peer.swarm.worker.done_fault`). A ``done``
for a step whose finish this stage did not pass down, or an ``apply`` for a step whose norms it did not send up,
was not asked for: a neighbour that sends one would step this stage at a rate of its choosing.

:class:`StepLedger` holds those numbers for the step under way; the stage server
(:class:`~hlbp.peer.swarm.server.StageServer`) fills it from its compute thread and asks it from its links' loop.
Each field is replaced whole, so a reader on the other thread sees an old or a new record, never half of one.
"""

from __future__ import annotations

from collections.abc import Callable

from hlbp.peer.swarm.worker import done_fault, finish_fault, wire_norm
from hlbp.peer.train.trainer import OptimConfig
from hlbp.protocol.stagewire import StageMessage


class StepLedger:
    """What this stage said about the step under way (see the module docstring)."""

    def __init__(self) -> None:
        self.count: tuple[int, int, int] = (-1, -1, 0)  # (session, step, micro-batches) of the step under way
        self.reported: tuple[int, int, float] | None = None  # (session, step, norm) sent up complete
        self.forwarded: tuple[int, int, float, float, float] | None = None  # the last finish passed down

    def started(self, msg: StageMessage) -> None:
        """A ``fwd`` of the step under way arrived: it says how many micro-batches the step has."""
        self.count = (msg.session, msg.step, msg.count)

    def below(self, msg: StageMessage) -> float | None:
        """The later stages' norm that a ``bwd`` from downstream brought complete, or None."""
        return msg.sumsq if msg.count and msg.count == self.count[2] else None

    def norms(self, msg: StageMessage, below: float | None, accumulated: int,
              sumsq: Callable[[], float]) -> tuple[float, int]:
        """``sumsq`` and ``count`` for the ``bwd`` of ``msg`` this stage sends up: its own squared gradient norm
        (``sumsq()``, asked only then) plus ``below`` (the later stages', complete; 0 on the last stage) once it
        has ``accumulated`` every micro-batch of the step; else nothing, and the driver asks with a ``finish``."""
        session, step, count = self.count
        if below is None or (session, step) != (msg.session, msg.step) or count <= 0 or accumulated != count:
            return 0.0, 0
        total = wire_norm(below + sumsq())
        self.reported = (msg.session, msg.step, total)
        return total, count

    def passed_down(self, msg: StageMessage, total: float) -> None:
        """This stage passed the ``finish`` of ``msg``'s step down with the norm ``total`` counted so far."""
        self.forwarded = (msg.session, msg.step, msg.lr, msg.max_norm, min(total, 1e300))

    def done_fault(self, msg: StageMessage) -> str | None:
        """Why a ``done`` from downstream must not be applied, or None."""
        forwarded = self.forwarded
        if forwarded is None or forwarded[:2] != (msg.session, msg.step):
            return f"a done of step {msg.step} whose finish this stage did not pass down"
        _session, _step, lr, max_norm, total = forwarded
        return done_fault(msg.lr, msg.scale, msg.sumsq, lr, max_norm, total)

    def apply_fault(self, msg: StageMessage, optim: OptimConfig) -> str | None:
        """Why the driver's ``apply`` from upstream must not be applied, or None."""
        fault = finish_fault(msg.lr, msg.opt_step, msg.max_norm, optim)
        if fault is not None:
            return fault
        reported = self.reported
        if reported is None or reported[:2] != (msg.session, msg.step):
            return f"an apply of step {msg.step}, whose norms this stage did not send up"
        return done_fault(msg.lr, msg.scale, msg.sumsq, msg.lr, msg.max_norm, reported[2])
