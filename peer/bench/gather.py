"""``hlbp bench gather``: what capping a round's gather set costs in loss, at equal tokens.

N replicas of the tiny model train in process (:mod:`hlbp.peer.sim.engine`) for the same rounds and inner steps
under several caps F: every replica trains every phase, so every run sees the same tokens, and only F
contributions a round reach the global parameters. A replica left out drops what it sent, as templar's miners do
(the manifest's default, ``unselected = "drop"``), or keeps it in its error feedback to send later: its backlog of
m phases as their average ("kept", ``OuterConfig.backlog``) or whole ("kept, summed"). Uncapped (F = N) is the
reference. The JSON holds every
curve; a PNG beside it plots validation loss against tokens.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hlbp.peer.bench.report import finish_loss_plot, print_table, write_result
from hlbp.peer.data.streams import prepare_data
from hlbp.peer.model.decoder import preset
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.sim.engine import EngineConfig, make_full_replicas, run_outer_simulation
from hlbp.peer.train.trainer import OptimConfig, pick_device


@dataclass(frozen=True)
class GatherBenchConfig:
    """N replicas, the caps to compare (``gathers``: each runs with the left-out mass dropped; F = N is the uncapped
    reference), and the caps also run keeping it (``kept``: averaged; ``summed``: whole)."""

    replicas: int = 32
    gathers: tuple[int, ...] = (4, 8, 16, 32)
    kept: tuple[int, ...] = (8,)  # caps also run keeping the left-out mass, its backlog sent as an average
    summed: tuple[int, ...] = (8,)  # ... and keeping it, the backlog sent whole (OuterConfig.backlog "sum")
    rounds: int = 30
    inner_steps: int = 5
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 10
    k: int = 64
    eval_batches: int = 16
    seed: int = 0
    model: str = "tiny"
    data: str = "builtin"
    cache_dir: Path | None = None
    jobs: int = 1

    @classmethod
    def quick(cls, **overrides: Any) -> GatherBenchConfig:
        """CI-sized: 8 replicas, F in {2, 4, 8}, 4 rounds of H = 2."""
        base = cls(replicas=8, gathers=(2, 4, 8), kept=(2,), summed=(2,), rounds=4, inner_steps=2, eval_batches=4)
        return dataclasses.replace(base, **overrides)

    def arms(self) -> list[tuple[str, int, str]]:
        """(label, F, what becomes of the left-out mass: "average", "sum" or "drop") per run; F = N is uncapped."""
        out = []
        for f in sorted(set(self.gathers)):
            if f >= self.replicas:
                out.append((f"F={f} (uncapped)", f, "drop"))
                continue
            out.append((f"F={f} dropped", f, "drop"))
            if f in self.kept:
                out.append((f"F={f} kept", f, "average"))
            if f in self.summed:
                out.append((f"F={f} kept, summed", f, "sum"))
        return out


def run_arm(cfg: GatherBenchConfig, gather: int, left_out: str, threads: int | None = None) -> dict[str, Any]:
    """One capped run; its result with the per-round history."""
    if threads:
        torch.set_num_threads(threads)
    device = pick_device("auto")
    data = prepare_data(cfg.data, cfg.cache_dir)
    model = preset(cfg.model, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    outer = OuterConfig(k=cfg.k, backlog="sum" if left_out == "sum" else "average")
    sim = EngineConfig(model=model, outer=outer, optim=OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup),
                       replicas=cfg.replicas, rounds=cfg.rounds, inner_steps=cfg.inner_steps,
                       batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, eval_batches=cfg.eval_batches,
                       gather=0 if gather >= cfg.replicas else gather, keep_unselected=left_out != "drop")
    return run_outer_simulation(sim, data, make_full_replicas(sim, data, device), device)


def verdict(results: dict[str, dict[str, Any]], cfg: GatherBenchConfig) -> dict[str, Any]:
    """Each arm's final loss over the uncapped reference's; per cap run both ways, whether each is within 1 % of
    uncapped and whether keeping beats dropping."""
    ref = next((lab for lab, f, _k in cfg.arms() if f >= cfg.replicas), None)
    if ref is None or ref not in results:
        return {}
    base = results[ref]["final_val_loss"]
    ratios = {lab: res["final_val_loss"] / base for lab, res in results.items()}
    out: dict[str, Any] = {"reference": ref, "ratio_to_uncapped": ratios}
    lines = [f"{lab}: {r:.4f}x" for lab, r in ratios.items() if lab != ref]
    for f in cfg.kept:
        kept, dropped = f"F={f} kept", f"F={f} dropped"
        if kept in results and dropped in results:
            out[f"F={f}"] = {"dropped_within_1pct": ratios[dropped] <= 1.01, "kept_within_1pct": ratios[kept] <= 1.01,
                             "kept_beats_dropped": ratios[kept] < ratios[dropped]}
    out["line"] = "final loss / uncapped: " + ", ".join(lines)
    return out


def write_plot(path: Path, results: dict[str, dict[str, Any]], title: str) -> bool:
    """Validation loss against tokens per arm; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (label, res) in enumerate(results.items()):
        xs = [r["tokens"] / 1e6 for r in res["history"]]
        ys = [r["val_loss"] for r in res["history"]]
        style = "--" if "summed" in label else ":" if "kept" in label else "-"
        for ax in (a, b):
            ax.plot(xs, ys, style, color=plt.get_cmap("tab10").colors[i % 10], lw=1.3, label=label)
    half = [r for res in results.values() for r in res["history"][len(res["history"]) // 2:]]
    if half:
        b.set_xlim(left=min(r["tokens"] for r in half) / 1e6)
        b.set_ylim(min(r["val_loss"] for r in half) - 0.02, max(r["val_loss"] for r in half) + 0.02)
    finish_loss_plot(fig, a, b, title, path, legend_size=8)
    return True


def run_gather_bench(cfg: GatherBenchConfig, out: Path | None = None,
                     console: Console | None = None) -> dict[str, Any]:
    """Run every arm (``jobs`` at once, one torch thread each), print the table, write JSON and the plot."""
    console = console or Console(stderr=True)
    arms = cfg.arms()
    prepare_data(cfg.data, cfg.cache_dir)  # tokenize once, before the workers start
    if cfg.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(processes=cfg.jobs) as pool:
            runs = [pool.apply_async(run_arm, (cfg, f, left_out, 1)) for _lab, f, left_out in arms]
            results = {lab: r.get() for (lab, _f, _k), r in zip(arms, runs)}
    else:
        results = {}
        for lab, f, left_out in arms:
            results[lab] = run_arm(cfg, f, left_out)
            console.print(f"  {lab:20s} final val {results[lab]['final_val_loss']:.4f}  "
                          f"{results[lab]['seconds']:.0f} s")
    v = verdict(results, cfg)
    title = (f"gather cap: {cfg.model}, N={cfg.replicas}, {cfg.rounds} rounds of H={cfg.inner_steps}, batch "
             f"{cfg.batch_size}x{cfg.seq_len}, k={cfg.k}")
    rows = [[lab, res["accepted_per_round"], res["final_val_loss"], min(r["val_loss"] for r in res["history"]),
             v.get("ratio_to_uncapped", {}).get(lab, float("nan")), res["tokens"], res["seconds"]]
            for lab, res in results.items()]
    print_table(console, title, ["arm", "accepted/round", "final val loss", "best val loss", "final / uncapped",
                                 "tokens", "seconds"], rows)
    if v:
        console.print(v["line"])
    doc = write_result(out, "gather", dataclasses.asdict(cfg), {"runs": results, "verdict": v})
    if out is not None and write_plot(Path(out).with_suffix(".png"), results, title):
        console.print(f"plot: {Path(out).with_suffix('.png')}")
    return doc
