"""``hlbp bench heterogeneous``: selective activation compression in a SparseLoCo run (docs/algorithms.md §3).

R replicas (default 4) train on the built-in corpus under SparseLoCo. In each cell of the matrix some of them are
pipeline replicas whose stage boundaries use a subspace codec and the rest are full replicas:

    variant {A, B, A+drift} x k/d {1/8, 1/32, 1/128} x compressed replicas {none, half, all}

``none`` is one shared cell: every replica full, the plain model. Every cell starts from the same weights and
sees the same tokens; the table reports the final validation loss of the global model and, for cells with
pipelines, the loss the global model scores when run through the compressed pipeline.

How the shared outer step stays consistent when only some replicas compress: the global model is one function,
so in the variants A every replica, full ones included, trains the constrained network
(:func:`hlbp.peer.model.pipeline.run_model_config`). That network applies U·Uᵀ to its embedding and writers in the
forward pass, so the parameters the sparse outer step produces are projected by every replica in the same,
deterministic way, and each replica re-projects its inner steps' changes (``SubspaceConstraint``), so no
pseudo-gradient carries anything outside span(U). The variants A therefore cost every replica the constraint,
whether it compresses or not; only bytes differ. In variant B no constraint exists: full replicas train the plain
model, and pipeline replicas rebuild T_fixed from the synchronized embedding after every outer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data.streams import TokenStream, prepare_data, val_batches
from hlbp.peer.model.codec import SHORT_NAMES, CodecConfig
from hlbp.peer.model.decoder import ModelConfig, balanced_partition, partition, preset
from hlbp.peer.model.pipeline import initial_state, run_model_config
from hlbp.peer.model.subspace import VARIANTS
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.sim.engine import EngineConfig, run_outer_simulation
from hlbp.peer.sim.pipeline import PipelineReplica, make_replica
from hlbp.peer.train.trainer import OptimConfig, evaluate, micro_batches, pick_device
from hlbp.protocol.manifest import describe_stages

SPLITS = ("none", "half", "all")
PARTITIONS = ("balanced", "even")  # how a pipeline's layers are cut into stages: as a run's manifest does, or evenly


@dataclass
class HeterogeneousBenchConfig:
    """Settings of the benchmark; ``quick`` shrinks them to a CI-sized smoke run."""

    model: str = "tiny"  # model preset
    replicas: int = 4  # replicas R; "half" makes R // 2 of them pipelines
    stages: int = 2  # stages of each pipeline replica
    rounds: int = 12  # outer rounds
    inner_steps: int = 15  # H: inner AdamW steps per round
    batch_size: int = 8  # sequences per inner step and replica
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak inner learning rate
    warmup: int = 20  # inner warm-up steps
    seed: int = 0  # init, data, U and T_fixed
    k: int = 64  # SparseLoCo values kept per 4096
    variants: tuple[str, ...] = VARIANTS  # subspace codecs to compare
    ratios: tuple[str, ...] = ("1/8", "1/32", "1/128")  # k/d of the activation codec
    splits: tuple[str, ...] = SPLITS  # how many replicas compress: none, half or all
    # the layers of each stage: "balanced" as the bootstrap writes a manifest (the last stage, which holds the head,
    # takes fewer: 3 + 1 on tiny), "even" as many layers each (2 + 2); under B it decides which boundary is lossy
    partition: str = "balanced"
    wire_dtype: str | None = None  # activation wire dtype; None: fp32 (lossless variant A)
    eval_batches: int = 8  # fixed validation batches
    data: str = "builtin"  # corpus spec
    vocab_size: int = 8192  # tokenizer size when one is trained
    cache_dir: Path | None = None  # data cache; None: the user cache
    device: str = "auto"  # auto, cpu or cuda[:N]

    @classmethod
    def quick(cls, **overrides: Any) -> HeterogeneousBenchConfig:
        base = cls(rounds=2, inner_steps=4, batch_size=4, seq_len=32, warmup=2, ratios=("1/32",), eval_batches=4)
        return dataclasses.replace(base, **overrides)


@dataclass(frozen=True)
class Cell:
    """One run of the matrix: ``compressed`` of the replicas are pipelines with ``codec`` at every boundary."""

    split: str
    compressed: int
    codec: CodecConfig | None  # None only for the shared all-full cell

    def label(self) -> str:
        if self.codec is None:
            return "none (all full)"
        return f"{SHORT_NAMES[self.codec.kind]} k/d={self.codec.rank} {self.split}"


def cells(cfg: HeterogeneousBenchConfig) -> list[Cell]:
    """The matrix in run order; ``none`` once, first."""
    n = {"none": 0, "half": cfg.replicas // 2, "all": cfg.replicas}
    out = [Cell("none", 0, None)] if "none" in cfg.splits else []
    for variant in cfg.variants:
        for ratio in cfg.ratios:
            codec = CodecConfig(variant, ratio, wire_dtype=cfg.wire_dtype, seed=cfg.seed)
            out.extend(Cell(split, n[split], codec) for split in cfg.splits if split != "none")
    return out


def stage_bounds(cfg: HeterogeneousBenchConfig, base: ModelConfig) -> list[tuple[int, int]]:
    """The layer range of each stage of the pipeline replicas, by ``cfg.partition``."""
    if cfg.partition not in PARTITIONS:
        raise UserInputError(f"partition must be one of {', '.join(PARTITIONS)}, got {cfg.partition!r}")
    if cfg.partition == "even":
        return partition(base.n_layers, cfg.stages)
    return balanced_partition(base, cfg.stages, cfg.seq_len)


def build_replicas(cfg: HeterogeneousBenchConfig, cell: Cell, base: ModelConfig, data: Any,
                   device: torch.device) -> tuple[ModelConfig, list[PipelineReplica]]:
    """The run's model config and its replicas; the last ``cell.compressed`` ranks are the pipelines."""
    codec = cell.codec or CodecConfig("dense", seed=cfg.seed)
    bounds = stage_bounds(cfg, base)
    config = run_model_config(base, codec, cfg.stages, bounds)
    state = initial_state(base, cfg.seed)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.rounds * cfg.inner_steps)
    replicas = []
    for r in range(cfg.replicas):
        stream = TokenStream(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=r)
        n_stages = cfg.stages if r >= cfg.replicas - cell.compressed else 1
        replicas.append(make_replica(f"replica-{r}", config, codec, n_stages, state, optim,
                                     micro_batches(stream, 1), device, bounds if n_stages > 1 else None))
    return config, replicas


def run_heterogeneous_bench(
    cfg: HeterogeneousBenchConfig, out: Path | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Run every cell, print the table and return (and optionally write) the full JSON document."""
    console = console or Console(stderr=True)
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size)
    base = preset(cfg.model, vocab_size=data.vocab_size, max_seq_len=max(cfg.seq_len, 8))
    val = val_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    outer = OuterConfig(kind="sparseloco", k=cfg.k)
    plan = cells(cfg)
    bounds = stage_bounds(cfg, base)  # rejects an unknown partition before any training
    for cell in plan:  # reject a bad k/d before any training
        if cell.codec is not None:
            cell.codec.k(base.d_model)
    results: list[dict[str, Any]] = []
    for cell in plan:
        label = cell.label()
        config, replicas = build_replicas(cfg, cell, base, data, device)
        sim = EngineConfig(model=config, outer=outer, replicas=cfg.replicas, rounds=cfg.rounds,
                        inner_steps=cfg.inner_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                        eval_batches=cfg.eval_batches)
        pipes = [r for r in replicas if len(r.model.stages) > 1]
        extra: dict[str, Any] = {}

        def show(rec: dict[str, Any], label: str = label, pipes: list = pipes, extra: dict = extra) -> None:
            console.print(f"  {label:28s} round {rec['round']:3d}  val {rec['val_loss']:.4f}  {rec['seconds']:7.1f}s")
            if rec["round"] == cfg.rounds and pipes:
                # right after the last outer step every replica holds the global model: score it as a pipeline
                extra["pipeline_val_loss"] = evaluate(pipes[0].model, val, device)

        res = run_outer_simulation(sim, data, replicas, device, on_round=show)
        codec = cell.codec
        meters = pipes[0].meters() if pipes else []
        results.append({
            "label": label,
            "variant": codec.kind if codec else None,
            "ratio": codec.rank if codec else None,
            "k": codec.k(base.d_model) if codec else base.d_model,
            "split": cell.split,
            "compressed_replicas": cell.compressed,
            "final_val_loss": res["final_val_loss"],
            "pipeline_val_loss": extra.get("pipeline_val_loss"),
            "activation_bytes_per_token": [
                {"forward": m["forward_bytes_per_token"], "backward": m["backward_bytes_per_token"]} for m in meters
            ],
            **{k: res[k] for k in ("history", "tokens", "seconds", "bytes_per_round_per_replica", "bits_per_param")},
        })
    none = next((r["final_val_loss"] for r in results if r["split"] == "none"), None)
    rows = []
    for r in results:
        bpt = r["activation_bytes_per_token"][0] if r["activation_bytes_per_token"] else None
        rows.append([
            SHORT_NAMES.get(r["variant"], "-"), r["ratio"] or "-", r["k"], r["split"], r["final_val_loss"],
            (r["final_val_loss"] - none) if none is not None else "-",
            r["pipeline_val_loss"] if r["pipeline_val_loss"] is not None else "-",
            bpt["forward"] if bpt else "-", bpt["backward"] if bpt else "-", r["seconds"],
        ])
    tokens = results[0]["tokens"] if results else 0
    print_table(
        console,
        f"heterogeneous: {cfg.model}, R={cfg.replicas}, {cfg.stages}-stage pipelines (layers "
        f"{describe_stages(bounds)}), H={cfg.inner_steps}, "
        f"{cfg.rounds} rounds, SparseLoCo k={cfg.k}, {tokens:,} tokens per cell",
        ["variant", "k/d", "k", "compressed", "final val loss", "- none", "pipeline val loss", "act fwd B/tok",
         "act bwd B/tok", "seconds"],
        rows,
    )
    config_doc = dataclasses.asdict(cfg)
    config_doc["model_config"] = dataclasses.asdict(base)
    config_doc["stage_bounds"] = [list(b) for b in bounds]
    config_doc["tokenizer_hash"] = data.tokenizer_hash
    config_doc["torch_threads"] = torch.get_num_threads()
    config_doc["consistency"] = (
        "variants A: every replica trains the constrained model; the outer step is projected identically by "
        "every replica; variant B: no constraint"
    )
    return write_result(out, "heterogeneous", config_doc, {"cells": results, "half_vs_all": half_vs_all(results)})


SAME_LOSS = 1e-4  # final losses closer than this count as equal: lossless codecs differ only by float rounding


def half_vs_all(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each variant and k/d with both splits: final losses and which split lost less (or "equal")."""
    out = []
    for r in results:
        if r["split"] != "half":
            continue
        match = next((a for a in results if a["split"] == "all" and a["variant"] == r["variant"]
                      and a["ratio"] == r["ratio"]), None)
        if match:
            gap = match["final_val_loss"] - r["final_val_loss"]
            verdict = "equal" if abs(gap) < SAME_LOSS else ("half" if gap > 0 else "all")
            out.append({"variant": r["variant"], "ratio": r["ratio"], "half": r["final_val_loss"],
                        "all": match["final_val_loss"], "all_minus_half": gap, "loses_less": verdict})
    return out
