"""``hlbp join`` as an honest stage peer on a slow device: every training pass it runs (a forward, a backward, or the
last stage's forward, loss and backward) takes ``FACTOR`` times as long, the extra spent asleep, and the throughput it
announces (probed, or given by ``--throughput``) is divided by ``FACTOR``, as a slow device's probe would measure.
A benchmark's slow device and a test's slow peer, on a machine whose cores the other peers share (a thread limit
slows nobody down when every peer has one thread).

Usage: ``python -m hlbp.cli.slowstage FACTOR join ...``. The built worker and the capacity measurement are wrapped
from here, through the entry point :func:`hlbp.peer.node.session.run_join`; the protocol's code calls no hook.
:func:`program` builds the command.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any


class SlowWorker:
    """A stage worker whose training passes each take ``factor`` times as long as ``inner``'s (it sleeps the
    difference after each); its results are honest, its throughput low.

    The extra is scaled from the CPU time the pass took in this thread, not its wall time: a slow device does more
    work per pass, while the time other processes take the core away from this one is the box's, not the device's.
    Scaled from wall time, one preemption of a tenth of a second on a busy box became 12 s asleep at factor 120.
    (The benchmark and the tests run one torch thread per peer, so a pass's work is this thread's.)"""

    def __init__(self, inner: Any, factor: float) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "factor", factor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the server sets the step it is at on its worker
        setattr(self.inner, name, value)

    def _slowly(self, run: Callable[[], Any]) -> Any:
        start = time.thread_time()
        out = run()
        time.sleep((self.factor - 1.0) * (time.thread_time() - start))
        return out

    def forward(self, mb: int, attempt: int, x: Any, train: bool = True) -> Any:
        if not train:
            return self.inner.forward(mb, attempt, x, train)
        return self._slowly(lambda: self.inner.forward(mb, attempt, x, train))

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self._slowly(lambda: self.inner.backward(*args, **kwargs))

    def loss_backward(self, *args: Any, **kwargs: Any) -> Any:
        return self._slowly(lambda: self.inner.loss_backward(*args, **kwargs))


def slow_capacity(measure: Callable[..., Any], factor: float) -> Callable[..., Any]:
    """``measure`` (:func:`hlbp.peer.node.capacity.measure`) as a device ``factor`` times slower reports it."""

    def measured(*args: Any, **kwargs: Any) -> Any:
        capacity = measure(*args, **kwargs)
        return dataclasses.replace(capacity, throughput=capacity.throughput / factor)

    return measured


def program(factor: float) -> list[str]:
    """The command that starts a joined stage peer whose training passes each take ``factor`` times as long."""
    return [sys.executable, "-m", "hlbp.cli.slowstage", str(factor)]


if __name__ == "__main__":
    from hlbp.cli.join_flags import join_plan
    from hlbp.peer.node import join
    from hlbp.peer.node.session import run_join

    if sys.argv[2:3] != ["join"] or not float(sys.argv[1]) >= 1.0:
        sys.exit("usage: python -m hlbp.cli.slowstage FACTOR join [FLAGS]  (FACTOR >= 1)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    factor = float(sys.argv[1])
    join.measure = slow_capacity(join.measure, factor)  # type: ignore[assignment]
    run_join(join_plan(sys.argv[3:]), lambda line: print(line, flush=True), lambda worker: SlowWorker(worker, factor))
