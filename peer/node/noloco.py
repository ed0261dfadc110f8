"""A full replica of a NoLoCo run (manifest ``outer = "noloco"``): its parts wired to the network.

:func:`hlbp.peer.node.replica.run_replica` builds the model, trainer, transport and metrics as for any run and
hands them here; the round loop is :class:`hlbp.peer.rounds.noloco_loop.NoLoCoRunner`. The partners of a round
come from the run's signed announcements: every online full replica that may contribute.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hlbp.peer.common.files import atomic_write_bytes
from hlbp.peer.rounds.noloco import NoLoCoConfig
from hlbp.peer.rounds.noloco_loop import NoLoCoRound, NoLoCoRunner

logger = logging.getLogger(__name__)


def noloco_config(hp: Any) -> NoLoCoConfig:
    """The outer step of a run's hyperparameters: SparseLoCo's payload settings (k, β as the error feedback's
    decay, the small-tensor rule) when the payload is sparse."""
    return NoLoCoConfig(sparse=hp.noloco_payload == "sparse", k=hp.k, ef_decay=hp.beta,
                        small_tensors=hp.small_tensors)


def online_replicas(plane: Any, m: Any) -> Callable[[], set[str]]:
    """A function returning the run's online full replicas as the announcements show them (empty when the read
    fails: the round is then taken alone, never waited on)."""

    def read() -> set[str]:
        try:
            peers = plane.read_peers(m.run_id)
        except Exception as exc:  # noqa: BLE001 - a failed read only means no partner this round
            logger.debug("reading peers failed: %s", exc)
            return set()
        return {p for p, a in peers.items()
                if a.announcement.role == "replica" and a.announcement.online and m.may_contribute(p)}

    return read


def run_noloco(ctx: Any, options: Any, trainer: Any, transport: Any, metrics: Any,
               evaluate: Callable[[Mapping[str, torch.Tensor]], float | None] | None,
               echo: Callable[[str], None], wait_for_replicas: Callable[..., bool]) -> dict[str, Any]:
    """Train with NoLoCo rounds until stopped or ``options.rounds`` rounds; returns (and writes to summary.json)
    what happened. ``wait_for_replicas``: :func:`hlbp.peer.node.replica.wait_for_replicas` (a fresh run's first
    round waits for the replicas started with it)."""
    peer = ctx.peer
    m = peer.manifest.manifest
    hp = m.hparams
    cfg = noloco_config(hp)
    peers = online_replicas(peer.plane, m)

    def on_round(done: NoLoCoRound) -> None:
        with_whom = (f"paired with {done.partner[:16]}" if done.paired else
                     f"alone ({'no partner' if done.partner is None else done.partner[:16] + ' not in time'})")
        echo(f"round {done.round}: {with_whom}, loss {done.train_loss:.4f}, val {done.val_loss or float('nan'):.4f}, "
             f"wait {done.wait_s:.1f}s, sent {done.bytes_sent:,} B recv {done.bytes_received:,} B"
             + (f", {done.bounded} tensors of the partner's bounded" if done.bounded else ""))

    runner = NoLoCoRunner(peer.plane.peer_id, trainer, transport, peers, cfg, m.run_id, str(m.seed),
                          hp.inner_steps, hp.round_deadline_s, ctx.stop,
                          checkpoint=ctx.out_dir / "checkpoint.safetensors", metrics=metrics, evaluate=evaluate,
                          on_round=on_round)
    if options.faults is not None:
        options.faults(runner)  # a fault test wraps the runner's parts (tests/peer/rounds/faulty_peer.py)
    start = time.perf_counter()
    how = runner.start()
    echo(f"replica: noloco ({cfg.label}), {how}; starting at round {runner.round}")
    if options.wait_replicas > 1 and runner.round == 0:
        wait_for_replicas(lambda: len(runner.ready_replicas()), options.wait_replicas,
                          options.wait_replicas_timeout_s, ctx.stop, echo, what="ready")
    try:
        history = runner.run(options.rounds)
    finally:
        transport.close()
        metrics.close()
    summary = {
        "peer": peer.plane.peer_id,
        "run": m.run_id,
        "seconds": round(time.perf_counter() - start, 2),
        "rounds": [dict(d.__dict__) for d in history],
        "final_round": runner.round - 1,
        "outer": "noloco",
        "payload": cfg.label,
    }
    atomic_write_bytes(ctx.out_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary
