"""One joined peer's process from its config objects: join the run, train as the role asks, leave.

The body of ``hlbp join``, kept here so that whatever starts a peer (the command line, or a fault test's entry point
that wraps a full replica's round parts) runs the same code from the same :class:`JoinPlan`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hlbp.peer.common.signals import stop_on_signals
from hlbp.peer.node.join import JoinConfig, TrainContext, join, run_local
from hlbp.peer.node.replica import ReplicaOptions, run_replica
from hlbp.peer.node.stage import StageOptions, run_stage


@dataclass(frozen=True)
class JoinPlan:
    """What one joined peer does: join with ``join``; then, as the role it gets asks, serve a stage with ``stage``,
    run outer rounds as a full replica with ``replica``, or (``local_only``) train alone with the inner trainer."""

    join: JoinConfig
    replica: ReplicaOptions = field(default_factory=ReplicaOptions)
    stage: StageOptions = field(default_factory=StageOptions)
    local_only: bool = False


def run_join(plan: JoinPlan, echo: Callable[[str], None], faults: Callable[[Any], None] | None = None) -> None:
    """Join, train until the plan's limits or until SIGTERM or SIGINT, then leave (marked offline).

    Installs the process's SIGTERM and SIGINT handlers: this is the whole life of a peer process. ``faults``
    wraps a full replica's round parts before it starts, or returns a stage peer's worker wrapped (a fault test's
    misbehaving peer); production leaves it out.
    """
    stop, training = threading.Event(), threading.Event()
    stop_on_signals(stop, training)
    cfg = plan.join
    threads = plan.replica.threads or plan.stage.threads
    if threads:  # before the capacity probe, so that it measures the speed this peer will train at
        import torch

        torch.set_num_threads(threads)
    peer = join(cfg, echo)
    try:
        out = Path(cfg.out_dir) / peer.manifest.manifest.run_id / peer.plane.peer_id[-12:]
        ctx = TrainContext(peer=peer, max_steps=cfg.max_steps, out_dir=out, cache_dir=cfg.cache_dir, stop=stop)
        if not cfg.train:
            echo("holding the role without training (--no-train); Ctrl-C or SIGTERM to leave")
            stop.wait()
        elif peer.role.kind != "replica":
            run_stage(ctx, replace(plan.stage, faults=faults), echo)
        elif not plan.local_only and not stop.is_set():
            run_replica(ctx, replace(plan.replica, faults=faults), echo)
        elif not stop.is_set():
            training.set()  # from here a signal also interrupts the training loop, which does not poll `stop`
            try:
                run_local(ctx)
            except KeyboardInterrupt:
                echo("stopping training")
            finally:
                training.clear()
    finally:
        echo("leaving: marking this peer offline")
        peer.leave()
