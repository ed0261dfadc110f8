"""``hlbp bench convergence``: SparseLoCo against DiLoCo and a single AdamW run at an equal token budget.

Every method starts from the same weights (seed) and sees the same number of tokens: R replicas × rounds × H
inner steps × batch. The single AdamW run takes R times the batch for rounds × H steps, the data-parallel ideal
that no low-communication method can beat on loss; it shows what communicating rarely costs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.data.streams import prepare_data
from hlbp.peer.model.decoder import preset
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.sim.engine import SimConfig, make_full_replicas, run_outer_simulation, run_single_adamw
from hlbp.peer.train.trainer import OptimConfig, pick_device


@dataclass
class ConvergenceBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run."""

    model: str = "tiny"
    replicas: int = 4
    rounds: int = 12
    inner_steps: int = 15
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    ks: tuple[int, ...] = (32, 64, 128)
    aggregations: tuple[str, ...] = ("mean", "selectors")
    alpha: float = 1.0  # SparseLoCo outer learning rate
    beta: float = 0.95  # SparseLoCo error-feedback decay
    only: tuple[str, ...] = ()  # run only methods whose label contains one of these substrings (baselines stay)
    diloco_lr: float = 0.7
    diloco_momentum: float = 0.9
    data: str = "builtin"
    vocab_size: int = 8192
    cache_dir: Path | None = None
    device: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls, **overrides: Any) -> ConvergenceBenchConfig:
        base = cls(rounds=3, inner_steps=5, batch_size=4, seq_len=64, warmup=5, ks=(64,))
        return dataclasses.replace(base, **overrides)


def methods(cfg: ConvergenceBenchConfig) -> list[tuple[str, OuterConfig | None]]:
    """(label, outer config) for every run; ``None`` is the single AdamW baseline."""
    out: list[tuple[str, OuterConfig | None]] = [("adamw (1 replica, R x batch)", None)]
    out.append(("diloco fp32", OuterConfig(kind="diloco", outer_lr=cfg.diloco_lr, momentum=cfg.diloco_momentum)))
    for k in cfg.ks:
        for agg in cfg.aggregations:
            label = f"sparseloco k={k} {agg}" + (f" a={cfg.alpha:g}" if cfg.alpha != 1.0 else "")
            out.append((label, OuterConfig(kind="sparseloco", k=k, aggregation=agg, alpha=cfg.alpha, beta=cfg.beta)))
    if cfg.only:
        out = out[:2] + [m for m in out[2:] if any(o in m[0] for o in cfg.only)]
    return out


def run_convergence_bench(
    cfg: ConvergenceBenchConfig, out: Path | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Run every method, print the table and return (and optionally write) the full JSON document."""
    console = console or Console(stderr=True)
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size)
    model = preset(cfg.model, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup)
    results: dict[str, Any] = {}
    for label, outer in methods(cfg):
        sim = SimConfig(
            model=model, outer=outer or OuterConfig(), optim=optim, replicas=cfg.replicas, rounds=cfg.rounds,
            inner_steps=cfg.inner_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
        )

        def show(rec: dict[str, Any], label: str = label) -> None:
            console.print(f"  {label:30s} round {rec['round']:3d}  val {rec['val_loss']:.4f}  {rec['seconds']:7.1f}s")

        if outer is None:
            res = run_single_adamw(sim, data, device, on_round=show)
        else:
            res = run_outer_simulation(sim, data, make_full_replicas(sim, data, device), device, on_round=show)
        results[label] = res
    dense = results["diloco fp32"]["bytes_per_round_per_replica"]
    ref = results["diloco fp32"]["final_val_loss"]
    rows = []
    for label, res in results.items():
        b = res["bytes_per_round_per_replica"]
        rows.append([
            label, res["final_val_loss"], res["final_val_loss"] / ref, int(b),
            (dense / b) if b else "-", res.get("bits_per_param", "-"), res["seconds"],
        ])
    print_table(
        console,
        f"convergence: {cfg.model}, R={cfg.replicas}, H={cfg.inner_steps}, {cfg.rounds} rounds, "
        f"{results['diloco fp32']['tokens']:,} tokens each",
        ["method", "final val loss", "loss / diloco", "bytes/round/replica", "dense/this", "bits/param", "seconds"],
        rows,
    )
    config = dataclasses.asdict(cfg)
    config["model_config"] = dataclasses.asdict(model)
    config["tokenizer_hash"] = data.tokenizer_hash
    config["torch_threads"] = torch.get_num_threads()
    return write_result(out, "convergence", config, results)
