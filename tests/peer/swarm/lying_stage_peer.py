"""``hlbp join`` as a stage peer that lies about what it computed: the liar of the pipeline audit tests, started as a
real process (or, in process, its :class:`LyingWorker` alone).

Usage: ``python lying_stage_peer.py WHERE:HOW[:EVERY][:from=STEP][:silent] join ...``: WHERE is ``forward`` (the
activations it passes on) or ``backward`` (the gradient it passes back), HOW is ``scale`` (x10), ``flip`` (sign) or
``noise`` (Gaussian of the same RMS), EVERY = n lies on every n-th micro-batch it computes only; ``from=STEP``: it
computes honestly until the run's inner step STEP (a liar that earns its neighbours' trust first); ``silent``: it
never announces a contribution of its own (so no audit of its contribution looks at it), while it serves its
swarm's steps. The
worker and the round runner's records are wrapped from here, through the test entry point
:func:`hlbp.peer.node.session.run_join`; the protocol's code calls no hook. Tests build the command with
:func:`program`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch


class LyingWorker:
    """A stage worker that lies about what it computed: ``where`` is "forward" (the activations it passes on) or
    "backward" (the gradient it passes back); ``how`` is "scale" (x10), "flip" (sign) or "noise" (Gaussian of the
    same RMS); ``every`` = n lies on every n-th micro-batch it computes only (``lied`` lists them); from the run's inner
step ``start`` on."""

    _OWN = ("inner", "where", "how", "every", "start", "count", "lied")

    def __init__(self, inner: Any, where: str, how: str, every: int = 1, start: int = 0) -> None:
        for name, value in zip(self._OWN, (inner, where, how, every, start, 0, [])):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the server sets the step it is at on its worker
        setattr(self.inner, name, value)

    def _lie(self, mb: int, attempt: int, t: torch.Tensor) -> torch.Tensor:
        if self.inner.step < self.start:
            return t
        object.__setattr__(self, "count", self.count + 1)
        if (self.count - 1) % self.every:
            return t
        self.lied.append((self.inner.session, self.inner.step, mb, attempt))
        if self.how == "scale":
            return t * 10
        if self.how == "flip":
            return -t
        return torch.randn_like(t) * t.pow(2).mean().sqrt()

    def forward(self, mb: int, attempt: int, x: torch.Tensor, train: bool = True) -> torch.Tensor:
        out = self.inner.forward(mb, attempt, x, train)
        return self._lie(mb, attempt, out) if self.where == "forward" and train else out

    def backward(self, mb: int, attempt: int, grad_out: torch.Tensor) -> torch.Tensor | None:
        grad = self.inner.backward(mb, attempt, grad_out)
        return self._lie(mb, attempt, grad) if self.where == "backward" and grad is not None else grad


class SilentNotices:
    """A stage peer's round records that never store its own contribution notices: it takes part in its swarm's
    steps and in the rounds, and contributes nothing anyone could audit it by."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def store(self, key: str, body: Any, kind: str, to: Any = frozenset(), only: Any = None) -> bytes:
        from hlbp.protocol.roundwire import KIND_CONTRIB

        return b"" if kind == KIND_CONTRIB else self.inner.store(key, body, kind, to, only)


def program(lie: str) -> list[str]:
    """The command that starts a joined stage peer lying as ``lie`` says (``WHERE:HOW[:EVERY][:from=STEP]``)."""
    return [sys.executable, str(Path(__file__).resolve()), lie]


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"]:
        sys.exit(f"usage: {sys.argv[0]} WHERE:HOW[:EVERY][:from=STEP][:silent] join [FLAGS]")
    from dataclasses import replace

    where, how, *rest = sys.argv[1].split(":")
    silent = "silent" in rest
    every = next((int(x) for x in rest if x.isdigit()), 1)
    start = next((int(x[5:]) for x in rest if x.startswith("from=")), 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = join_plan(sys.argv[3:])
    if silent:
        plan = replace(plan, stage=replace(plan.stage, round_faults=lambda runner: setattr(
            runner, "records", SilentNotices(runner.records))))
    run_join(plan, lambda line: print(line, flush=True), lambda worker: LyingWorker(worker, where, how, every, start))
