"""``hlbp train``: one model trained locally on one machine, with progress, metrics, checkpoints and resume."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import atomic_write_bytes, remove_stale_temps
from hlbp.peer.data.streams import TokenStream, prepare_data, val_batches
from hlbp.peer.model.decoder import build_model, count_parameters, preset
from hlbp.peer.train.checkpoint import open_checkpoint, save_checkpoint
from hlbp.peer.train.export import ModelInfo, write_model_info
from hlbp.peer.train.metricslog import MetricsLog
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, Throughput, micro_batches, pick_device

CHECKPOINT_NAME = "checkpoint.safetensors"


@dataclass
class LocalRunConfig:
    """Everything ``hlbp train`` needs; each field maps to one CLI flag and one HLBP_* variable."""

    model: str = "tiny"  # model preset name
    steps: int = 300  # optimizer steps to train in total (a resumed run continues up to this)
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int | None = None  # tokens per sequence; None means the preset's max_seq_len
    data: str = "builtin"  # corpus spec: builtin, paths, or hf:NAME
    vocab_size: int = 8192  # BPE vocabulary when the tokenizer is trained here
    tokenizer: Path | None = None  # an existing tokenizer.json instead of training one
    cache_dir: Path | None = None  # where corpus, tokenizer and token arrays are cached
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval_every: int = 50  # optimizer steps between validation passes
    eval_batches: int = 8  # fixed validation batches per pass
    seed: int = 0  # seeds model init and the data stream
    rank: int = 0  # data stream rank: different ranks draw different windows
    device: str = "auto"  # auto, cpu, cuda
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    out_dir: Path = Path("runs/train")  # checkpoint, metrics.jsonl and summary.json go here
    checkpoint_every: int = 100  # optimizer steps between checkpoints; the last step is always saved
    resume: bool = False  # continue from out_dir's checkpoint if it exists
    progress: bool = True  # show a rich progress bar
    recompute: bool = False  # each block's forward run again in the backward, its activations not held (Stage)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "checkpoint_every", "vocab_size"):
            if getattr(self, name) < 1:
                raise UserInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 2:
            raise UserInputError(f"--seq-len must be >= 2, got {self.seq_len}")
        if self.threads is not None and self.threads < 1:
            raise UserInputError(f"--threads must be >= 1, got {self.threads}")
        self.optim.validate()


def run_local_training(cfg: LocalRunConfig, console: Console | None = None) -> dict[str, Any]:
    """Train, evaluating and checkpointing as configured; returns the summary also written to summary.json."""
    console = console or Console(stderr=True)
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    data = prepare_data(cfg.data, cfg.cache_dir, vocab_size=cfg.vocab_size, tokenizer_path=cfg.tokenizer)
    config = preset(cfg.model, vocab_size=data.vocab_size)
    seq_len = cfg.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise UserInputError(f"--seq-len {seq_len} exceeds the {cfg.model} preset's max of {config.max_seq_len}")
    torch.manual_seed(cfg.seed)
    model = build_model(config)
    model.recompute = cfg.recompute
    stream = TokenStream(data.train, seq_len, cfg.batch_size, seed=cfg.seed, rank=cfg.rank)
    val = val_batches(data.val, seq_len, cfg.batch_size, cfg.eval_batches)
    optim = dataclasses.replace(cfg.optim, total_steps=cfg.steps)
    trainer = InnerTrainer(model, optim, micro_batches(stream, optim.grad_accum), device)

    out = Path(cfg.out_dir)
    ckpt = out / CHECKPOINT_NAME
    # hlbp export and generate read these beside the checkpoint
    write_model_info(out, ModelInfo("local", config, data.eot_id, cfg.batch_size * seq_len * cfg.optim.grad_accum),
                     data.tokenizer_path)
    identity = {"model": dataclasses.asdict(config), "tokenizer_hash": data.tokenizer_hash, "seed": cfg.seed}
    remove_stale_temps(ckpt)  # what a save killed mid-write left behind, as large as the checkpoint
    if cfg.resume and ckpt.exists():
        tensors, header = open_checkpoint(ckpt)
        if header.get("identity") != identity:
            raise UserInputError(
                f"{ckpt} was written for another model, tokenizer or seed; use a new --out-dir or drop --resume"
            )
        trainer.load_state(tensors, header)
        console.print(f"resumed from {ckpt} at step {trainer.step}")
    elif ckpt.exists():
        raise UserInputError(f"{ckpt} already exists; pass --resume to continue it or choose another --out-dir")

    n_params = count_parameters(model)
    console.print(
        f"[bold]hlbp train[/]: {cfg.model} ({n_params / 1e6:.2f}M params), {len(data.train):,} train / "
        f"{len(data.val):,} val tokens, vocab {data.vocab_size}, batch {cfg.batch_size}x{seq_len}, "
        f"{trainer.step}->{cfg.steps} steps on {device}"
    )
    metrics = MetricsLog(out / "metrics.jsonl")
    rate = Throughput()
    history: list[dict[str, float]] = []
    first_val = trainer.evaluate(val)
    history.append({"step": trainer.step, "val_loss": first_val})
    metrics.write(event="eval", step=trainer.step, tokens=trainer.tokens, val_loss=first_val)
    start = time.perf_counter()
    steps_done, loss, val_loss = 0, math.nan, first_val

    def save() -> None:
        tensors, header = trainer.state_tensors()
        save_checkpoint(ckpt, tensors, {**header, "identity": identity})

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  val {task.fields[val]:.3f}  {task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        disable=not cfg.progress,
    )
    with progress, metrics:
        task = progress.add_task("train", total=cfg.steps, completed=trainer.step, loss=math.nan, val=val_loss, tps=0)
        while trainer.step < cfg.steps:
            loss = trainer.train_step()
            steps_done += 1
            rate.add(optim.grad_accum * cfg.batch_size * seq_len)
            metrics.write(event="train", step=trainer.step, tokens=trainer.tokens, loss=loss, lr=trainer.optimizer.param_groups[0]["lr"])
            if trainer.step % cfg.eval_every == 0 or trainer.step == cfg.steps:
                val_loss = trainer.evaluate(val)
                history.append({"step": trainer.step, "val_loss": val_loss})
                metrics.write(event="eval", step=trainer.step, tokens=trainer.tokens, val_loss=val_loss)
            if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
                save()
            progress.update(task, completed=trainer.step, loss=loss, val=val_loss, tps=rate.tokens_per_s)
    elapsed = time.perf_counter() - start
    summary = {
        "model": cfg.model,
        "params": n_params,
        "device": str(device),
        "recompute": model.recompute,
        "steps": trainer.step,
        "tokens": trainer.tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(steps_done * optim.grad_accum * cfg.batch_size * seq_len / max(elapsed, 1e-9), 1),
        "first_val_loss": round(history[0]["val_loss"], 4),
        "final_val_loss": round(history[-1]["val_loss"], 4),
        "final_train_loss": round(loss, 4) if math.isfinite(loss) else None,
        "val_history": history,
        "tokenizer_hash": data.tokenizer_hash,
        "checkpoint": str(ckpt),
    }
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2).encode())
    console.print(
        f"done: {trainer.step} steps, val loss {summary['first_val_loss']:.3f} -> {summary['final_val_loss']:.3f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, {elapsed:.1f} s. Summary: {out / 'summary.json'}"
    )
    return summary
