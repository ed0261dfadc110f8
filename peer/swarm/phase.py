"""Stage 0's side of a swarm's inner phase: the driver's steps of one outer round, logged, checkpointed and scored.

A :class:`SwarmPhase` owns what the driving stage peer keeps between steps (its optimizer step, its place in the
token stream, the validation losses so far) and answers the round loop's two questions: run the inner phase of
round r (:meth:`SwarmPhase.run`) and score the round's result (:meth:`SwarmPhase.score`). It knows nothing of the
round loop itself: whether round r has closed without the swarm comes in as a callable, and reaching the step
limit is :class:`StepLimitReached`, which the caller turns into whatever ends its round loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hlbp.peer.swarm.driver import Driver, StepAbandoned
from hlbp.peer.swarm.guardslot import GUARD_TIMEOUT_S

Batch = tuple[torch.Tensor, torch.Tensor]


class StepLimitReached(Exception):
    """The driver took the steps it was allowed (``--max-steps``): the phase ends with no round to exchange."""


class BatchSource(Protocol):
    def batch(self, seq: int) -> Batch: ...


class MetricsSink(Protocol):
    def write(self, **record: Any) -> None: ...


@dataclass(frozen=True)
class PhaseConfig:
    """How the driving peer runs its phases; from the run's manifest and this peer's options."""

    inner_steps: int  # H: steps per outer round, the last marked as the round's end
    step_tokens: int  # tokens of one step's batch (what the round's contribution is weighted by)
    eval_every: int = 10  # validation loss every this many steps (0: never)
    checkpoint_every_s: float = 60.0
    max_steps: int | None = None  # steps this role may take (None: no limit)


def due_for_validation(opt_step: int, eval_every: int) -> bool:
    """Whether the step that brought the optimizer to ``opt_step`` is scored on the validation batches."""
    return bool(eval_every) and opt_step % eval_every == 0


def needs_last_validation(scored: int, opt_step: int, eval_every: int) -> bool:
    """Whether the end of the run still needs a validation loss: none was taken (``scored``), periodic scoring is
    off, or the last step was not one that got scored."""
    return not scored or not due_for_validation(opt_step, eval_every)


def driver_report(summary: dict[str, Any]) -> str:
    """The one line a driving peer prints about its run, from :meth:`SwarmPhase.summary`."""
    losses = summary["val_losses"]
    return (f"driver: {summary['steps']} steps, {summary['steps_abandoned']} abandoned, {summary['microbatches']} "
            f"micro-batches done, {summary['microbatches_retried']} retried, {summary['microbatches_abandoned']} "
            f"abandoned, {summary['tokens_per_s']:,.0f} tokens/s"
            + (f", validation {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""))


class StickyCheck:
    """``check()`` asked at most every ``seconds`` (a DHT read each time), and True for good once it was True."""

    def __init__(self, check: Callable[[], bool], seconds: float) -> None:
        self.check, self.seconds = check, seconds
        self.value = False
        self._at = 0.0

    def __call__(self) -> bool:
        if not self.value and time.monotonic() - self._at >= self.seconds:
            self.value, self._at = bool(self.check()), time.monotonic()
        return self.value


class SwarmPhase:
    """The driver's inner phases, one per outer round, from ``start_step`` on.

    ``lr(opt_step)``: the learning rate of a step; ``save(opt_step)``: checkpoint this peer's stage (every
    ``checkpoint_every_s`` seconds, and at the end); ``round_closed(r)``: whether round r has closed without the
    swarm (asked at most every half second); ``echo``: a line for the operator."""

    def __init__(self, driver: Driver, stream: BatchSource, val: Sequence[Batch], metrics: MetricsSink,
                 cfg: PhaseConfig, lr: Callable[[int], float], save: Callable[[int], None],
                 round_closed: Callable[[int], bool], stop: threading.Event, echo: Callable[[str], None],
                 start_step: int = 0, guard_batch: Batch | None = None) -> None:
        self.driver, self.stream, self.val, self.metrics, self.cfg = driver, stream, list(val), metrics, cfg
        self.guard_batch = guard_batch  # the run's fixed guard batch (None: the swarm runs no loss guard)
        self.lr, self.save_stage, self.round_closed = lr, save, round_closed
        self.stop, self.echo = stop, echo
        self.start_step = start_step
        self.opt_step = start_step  # the next optimizer step
        self.seq = start_step  # the next batch of the token stream (abandoned steps use one too)
        self.val_losses: list[float] = []
        self.started = time.perf_counter()
        self._saved = time.monotonic()

    def run(self, r: int) -> tuple[int, int]:
        """The swarm's inner phase of round r: up to H steps, the last marked as the round's end, cut short when
        the round closes without the swarm; (steps, tokens). Raises :class:`StepLimitReached`."""
        self.driver.wait_ready(60.0, r)  # the chain has loaded the last round's result
        steps = tokens = 0
        closed = StickyCheck(lambda: self.round_closed(r), 0.5)
        inner = self.cfg.inner_steps
        waiting = False
        while steps < inner:
            if self.stop.is_set():
                break  # the steps so far go into the error-feedback buffer of the round loop
            if self.cfg.max_steps is not None and self.opt_step >= self.start_step + self.cfg.max_steps:
                raise StepLimitReached("--max-steps reached")
            if closed():
                self.echo(f"round {r} closed after {steps} of the swarm's {inner} steps; taking its result")
                break
            if not self.driver.has_chain():  # a stage has no usable peer: a straggler until one serves it
                if not waiting:
                    self.echo(f"round {r}: no complete chain of stage peers; waiting for one")
                    waiting = True
                self.stop.wait(0.5)
                continue
            if self.step(r, round_end=steps + 1 == inner, give_up=closed, inner=steps):
                steps += 1
                tokens += self.cfg.step_tokens
        return steps, tokens

    def step(self, r: int, round_end: bool, give_up: Callable[[], bool] | None = None, inner: int = 0) -> bool:
        """One inner step of round r through the chain, ``inner`` steps of its phase done, logged (and scored when
        due); False if it was abandoned."""
        x, y = self.stream.batch(self.seq)
        record: dict[str, Any] = {"event": "step", "step": self.opt_step, "seq": self.seq, "round": r}
        self.seq += 1
        try:
            result = self.driver.train_step(x, y, self.opt_step, self.lr(self.opt_step), round_end=round_end,
                                            give_up=give_up, round_r=r, inner=inner)
        except StepAbandoned as exc:
            record.update(abandoned=str(exc))
            done = False
        else:
            self.opt_step += 1
            done = True
            record.update(loss=result.loss, seconds=result.seconds, retried=result.retried, chain=result.chain)
            if any(len(stage) > 1 for stage in result.serving):
                record["serving"] = result.serving
            if self.val and due_for_validation(self.opt_step, self.cfg.eval_every):
                v = self.driver.evaluate(self.val)
                if v is not None:
                    self.val_losses.append(v)
                    record["val_loss"] = v
            self.echo(f"step {self.opt_step - 1}: loss {result.loss:.4f} in {result.seconds:.2f} s"
                      + (f", {result.retried} micro-batches retried" if result.retried else "")
                      + (f", val {record['val_loss']:.4f}" if "val_loss" in record else ""))
        c = self.driver.counters
        record.update(tokens=c.tokens, microbatches=c.microbatches, microbatches_retried=c.microbatches_retried,
                      microbatches_abandoned=c.microbatches_abandoned, steps_abandoned=c.steps_abandoned)
        self.metrics.write(**record)
        if time.monotonic() - self._saved >= self.cfg.checkpoint_every_s:
            self.save()
        return done

    def score(self, _anchor: object = None) -> float | None:
        """The validation loss of the round's result (the round loop's ``evaluate``): the chain's stage weights
        are the anchor when the round loop reports (stage peers never overlap), so the chain scores them."""
        self.driver.wait_ready(60.0)
        return self.driver.evaluate(self.val)

    def guard(self, r: int, params: Mapping[str, torch.Tensor]) -> float | None:
        """The round loop's guard loss: round ``r``'s candidate scored on the guard batch through the chain, this
        stage at ``params`` and every other at the candidate it holds (:mod:`hlbp.peer.swarm.guardslot`)."""
        if self.guard_batch is None:
            return None
        return self.driver.guard_loss(r, params, self.guard_batch, GUARD_TIMEOUT_S)

    def validate_first(self) -> None:
        """The validation loss before training, said and kept (if there are validation batches)."""
        if not self.val:
            return
        first = self.driver.evaluate(self.val)
        if first is not None:
            self.val_losses.append(first)
            self.echo(f"validation loss before training: {first:.4f}")

    def validate_last(self) -> None:
        """The validation loss at the end, unless the last step was already scored."""
        if self.val and needs_last_validation(len(self.val_losses), self.opt_step, self.cfg.eval_every):
            v = self.driver.evaluate(self.val)
            if v is not None:
                self.val_losses.append(v)

    def save(self) -> None:
        """Checkpoint this peer's stage at the current optimizer step."""
        self.save_stage(self.opt_step)
        self._saved = time.monotonic()

    def close(self) -> None:
        """Close the driver's stage streams (the phase runs no more steps)."""
        self.driver.close()

    def steps_done(self) -> int:
        """Steps the driver finished (the rebalancer's measure of this peer's work)."""
        return self.driver.counters.steps

    def summary(self) -> dict[str, Any]:
        """The driver's counters, throughput and validation losses since this phase object started."""
        wall = time.perf_counter() - self.started
        c = self.driver.counters
        return {"steps": c.steps, "steps_abandoned": c.steps_abandoned, "steps_skipped": c.steps_skipped,
                "microbatches": c.microbatches, "microbatches_retried": c.microbatches_retried,
                "microbatches_abandoned": c.microbatches_abandoned, "failures": c.failures, "tokens": c.tokens,
                "seconds": wall, "tokens_per_s": c.tokens / max(wall, 1e-9), "val_losses": list(self.val_losses),
                "busy_fractions": self.driver.busy_fractions(wall), "opt_step": self.opt_step,
                "busy_s": dict(c.busy_s), "stream_bytes": self.driver.links.byte_totals()}
