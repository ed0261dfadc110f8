"""The state of one inner step of a swarm's driver (pure, no network): its micro-batches, the chain they travel,
and which of them are in flight, to be sent, or done.

:class:`hlbp.peer.swarm.stepper.StepRunner` owns one :class:`StepState` per step and changes it from its event
handlers; the questions asked of it (what is in flight, what is left to send, how the batch splits) live here so
they can be tested without a swarm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch


@dataclass
class StepResult:
    loss: float  # token-weighted mean training loss of the step
    seconds: float
    chain: list[str]
    retried: int
    serving: list[list[str]] = field(default_factory=list)  # every peer that served each stage (chain's first)


class Abandon(Enum):
    """Why a step was abandoned."""

    NO_CHAIN = "no chain"  # no complete chain of stage peers within the wait
    STOPPING = "stopping"  # this peer is stopping
    DEADLINE = "deadline"  # past the deadline although every stage peer answers (or the finish was lost)
    ALREADY_APPLIED = "already applied"  # a stage already applied the step: re-running it cannot help
    NAMED_AS_FAILED = "named as failed"  # a stage named this driver as the failed peer
    NO_REPLACEMENT = "no replacement"  # no stage peer can replace the one that failed
    TOO_MANY_ATTEMPTS = "too many attempts"  # a micro-batch failed ``max_attempts`` times


class StepAbandoned(RuntimeError):
    """The step could not finish; its state was dropped everywhere and it is counted. ``cause`` says why (the
    message is for the log)."""

    def __init__(self, cause: Abandon, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause


@dataclass
class MicroBatch:
    """One micro-batch of the step: its inputs and targets, its share of the step's tokens, and its attempts."""

    x: torch.Tensor
    y: torch.Tensor
    weight: float
    attempt: int = -1  # -1: never sent
    sent_at: float = 0.0
    done: bool = False
    loss: float = 0.0


@dataclass
class StepState:
    """The step under way: its micro-batches, the chain they travel and how far the step has come."""

    mbs: list[MicroBatch]
    chain: list[str]
    window: int  # most micro-batches in the chain at once
    opt_step: int
    lr: float
    tokens: int
    round_end: bool
    give_up: Callable[[], bool] | None
    started: float  # perf_counter at the start
    round: int = 0  # the outer round whose phase the step belongs to (every frame carries it)
    inner: int = 0  # steps applied in that phase before this one (0: every stage is at the round's anchor)
    retried: int = 0
    waits: int = 0  # deadlines renewed because a stage said it is exchanging a round (bounded: a peer may lie)
    finishing: bool = False  # every micro-batch is done and the finish is under way
    finish_at: float = 0.0  # monotonic time the finish was sent (or its deadline renewed)
    # the squared gradient norm of every later stage, as the newest backward brought it complete (None: it did not,
    # and the step asks for it with a finish)
    below: float | None = None
    serving: list[list[str]] = field(default_factory=list)  # the peers serving each stage (chain[k] first of k)
    routes: list[list[str]] = field(default_factory=list)  # each micro-batch's peer at each stage

    def peers(self) -> list[str]:
        """Every stage peer of the step: the chain's and those serving a stage beside it."""
        return [p for stage in self.serving for p in stage] if self.serving else list(self.chain)

    def shared(self) -> bool:
        """Whether some stage is served by more than one peer (its peers trade gradients at the step's end)."""
        return any(len(stage) > 1 for stage in self.serving)

    def route(self, i: int) -> list[str]:
        """The peers micro-batch ``i`` goes through."""
        return self.routes[i] if i < len(self.routes) else self.chain

    def inflight(self) -> list[int]:
        """The micro-batches sent and not yet back."""
        return [i for i, m in enumerate(self.mbs) if m.attempt >= 0 and not m.done and m.sent_at > 0]

    def unsent(self) -> list[int]:
        """The micro-batches never sent, or to be sent again."""
        return [i for i, m in enumerate(self.mbs) if m.attempt < 0 or (not m.done and m.sent_at == 0)]


    def oldest_sent(self) -> float | None:
        """When the oldest micro-batch in flight was sent (the finish, once it is under way); None if none is."""
        if self.finishing:
            return self.finish_at
        return min((self.mbs[i].sent_at for i in self.inflight() if self.mbs[i].sent_at), default=None)

    def loss(self) -> float:
        """The step's training loss: each micro-batch's loss weighted by its share of the tokens."""
        return sum(m.loss * m.weight for m in self.mbs)


@dataclass(frozen=True)
class PeerFailed:
    """What a handler of the step found: ``peer`` failed, so the step moves to another chain."""

    peer: str


class Schedule(Enum):
    """How a step's batch is cut into micro-batches (:func:`micro_batch_rows`)."""

    UNIFORM = "uniform"  # equal micro-batches (the first ones one row longer where the rows do not divide)
    TAPERED = "tapered"  # the first and the last a quarter of the others' rows (at least one), the rest equal


def micro_batch_rows(rows: int, count: int, schedule: Schedule = Schedule.UNIFORM) -> list[int]:
    """The rows (sequences) of each of at most ``count`` micro-batches of a batch of ``rows``.

    Why taper: the step is synchronous, so the busiest stage idles while the step's first micro-batch travels
    down to it (fill) and while its last travels back up to the driver (drain). Both waits are the other stages'
    compute on one micro-batch, so a short first and last micro-batch shorten them; the step's gradient is the
    same sum, each micro-batch weighted by its share of the tokens. Fewer than 4 micro-batches are cut uniformly.
    Measured with ``hlbp bench pipeline --schedules`` (docs/results.md): the busiest stage idles a point or two
    less, tokens/s moves within the box's run-to-run spread, so uniform stays the default.
    """
    n = min(count, rows)
    if schedule is Schedule.TAPERED and n >= 4:
        edge = max(1, rows // n // 4)
        q, r = divmod(rows - 2 * edge, n - 2)
        return [edge] + [q + 1] * r + [q] * (n - 2 - r) + [edge]
    q, r = divmod(rows, n)
    return [q + 1] * r + [q] * (n - r)


def micro_batches(x: torch.Tensor, y: torch.Tensor, count: int,
                  schedule: Schedule = Schedule.UNIFORM) -> list[MicroBatch]:
    """The batch (x, y) [batch, seq] cut into at most ``count`` micro-batches as ``schedule`` says
    (:func:`micro_batch_rows`), each weighted by its share of the targets (so the step's gradient is the whole
    batch's)."""
    rows = micro_batch_rows(x.shape[0], count, schedule)
    pairs = zip(torch.split(x, rows), torch.split(y, rows))
    return [MicroBatch(a, b, b.numel() / y.numel()) for a, b in pairs]
