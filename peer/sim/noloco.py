"""In-process NoLoCo: R replicas paired anew each round, the convergence benchmark's engine for it.

As in :mod:`hlbp.peer.sim.engine`, every replica lives in this process but each message goes through its wire
bytes (encoded, counted, parsed and checked as a partner's would be), so the loss reflects what peers would apply
and the byte counts are real. The replicas never share one set of parameters, so a round's validation loss is
the mean of the replicas' own (each scores its outer weights), and the spread says how far apart they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hlbp.peer.data.streams import PreparedData, val_batches
from hlbp.peer.model.decoder import build_model
from hlbp.peer.rounds.noloco import (
    NoLoCoConfig,
    NoLoCoState,
    message,
    message_from_bytes,
    message_to_bytes,
    partners,
    spread,
    step,
)
from hlbp.peer.sim.engine import EngineConfig, EngineReplica
from hlbp.peer.train.trainer import evaluate


def run_noloco_simulation(
    cfg: EngineConfig,
    noloco: NoLoCoConfig,
    data: PreparedData,
    replicas: Sequence[EngineReplica],
    device: torch.device,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg.rounds`` NoLoCo rounds; per round: the replicas' mean validation loss, their spread and the bytes
    each sent (one message to its partner; an unpaired replica sends nothing)."""
    noloco.validate()
    torch.manual_seed(cfg.seed)
    start_params = {n: t.detach().float().cpu().clone() for n, t in replicas[0].params().items()}
    for rep in replicas[1:]:
        rep.load_params(start_params)
    states = [NoLoCoState.start(start_params) for _ in replicas]
    shapes = {n: tuple(t.shape) for n, t in start_params.items()}
    evaluator = build_model(cfg.model).to(device)
    val = val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    names = [rep.name for rep in replicas]

    def val_loss() -> float:
        losses = []
        for s in states:
            with torch.no_grad():
                for n, p in evaluator.named_parameters():
                    p.copy_(s.phi[n])
            losses.append(evaluate(evaluator, val, device))
        return sum(losses) / len(losses)

    history = [{"round": 0, "tokens": 0, "val_loss": val_loss(), "spread": 0.0, "bytes_per_replica": 0,
                "seconds": 0.0}]
    if on_round:
        on_round(history[-1])
    start = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        wires: dict[str, bytes] = {}
        mine = []
        for rep, s in zip(replicas, states):
            rep.train(cfg.inner_steps)
            msg = message(s, rep.params(), noloco)
            mine.append(msg)
            wires[rep.name] = message_to_bytes(msg, noloco, rep.name, "sim", rnd)
        pairs = partners(names, str(cfg.seed), rnd)
        sent = sum(len(wires[n]) for n in names if pairs[n] is not None)
        for rep, s, msg in zip(replicas, states, mine):
            other = pairs[rep.name]
            theirs = None if other is None else message_from_bytes(wires[other], noloco, shapes, "sim", rnd)
            rep.load_params(step(s, msg, theirs, noloco))
        record = {
            "round": rnd,
            "tokens": sum(rep.tokens for rep in replicas),
            "val_loss": val_loss(),
            "spread": spread([s.phi for s in states]),
            "bytes_per_replica": sent / len(replicas),
            "seconds": round(time.perf_counter() - start, 2),
        }
        history.append(record)
        if on_round:
            on_round(record)
    n_params = sum(t.numel() for t in start_params.values())
    paired = max(1, len(replicas) - len(replicas) % 2)
    per_paired = history[-1]["bytes_per_replica"] * len(replicas) / paired
    return {
        "history": history,
        "final_val_loss": history[-1]["val_loss"],
        "final_spread": history[-1]["spread"],
        "bytes_per_round_per_replica": history[-1]["bytes_per_replica"],
        "bits_per_param": 8 * per_paired / n_params,
        "params": n_params,
        "tokens": history[-1]["tokens"],
        "seconds": history[-1]["seconds"],
        "bounded": sum(st.bounded for st in states),  # partners' tensors scaled down to the bounds (honest: 0)
    }
