"""``hlbp join`` as an honest stage peer that computes slowly: each training pass it runs (a forward, or the last
stage's forward, loss and backward) sleeps first. A benchmark's slow device and a test's slow peer, on a machine
whose cores the other peers share (a thread limit slows nobody down when every peer has one thread).

Usage: ``python -m hlbp.cli.slowstage SECONDS join ...``. The built worker is wrapped from here, through the
entry point :func:`hlbp.peer.node.session.run_join`; the protocol's code calls no hook. :func:`program` builds the
command.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch


class SlowWorker:
    """A stage worker that sleeps ``delay`` seconds before each training pass of a micro-batch and otherwise computes
    as ``inner`` does: its results are honest, its throughput low."""

    def __init__(self, inner: Any, delay: float) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "delay", delay)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the server sets the step it is at on its worker
        setattr(self.inner, name, value)

    def forward(self, mb: int, attempt: int, x: torch.Tensor, train: bool = True) -> torch.Tensor:
        if train:
            time.sleep(self.delay)
        return self.inner.forward(mb, attempt, x, train)

    def loss_backward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return self.inner.loss_backward(*args, **kwargs)


def program(delay: float) -> list[str]:
    """The command that starts a joined stage peer whose training passes each sleep ``delay`` seconds."""
    return [sys.executable, "-m", "hlbp.cli.slowstage", str(delay)]


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"]:
        sys.exit("usage: python -m hlbp.cli.slowstage SECONDS join [FLAGS]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seconds = float(sys.argv[1])
    run_join(join_plan(sys.argv[3:]), lambda line: print(line, flush=True), lambda worker: SlowWorker(worker, seconds))
