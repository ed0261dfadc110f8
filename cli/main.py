"""The ``hlbp`` command. A thin shell: parse flags (each also an HLBP_* variable), call hlbp.peer, print."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer

from hlbp.cli import bench_memory, bench_pipeline, bench_scale  # noqa: F401 - register their commands on bench_app
from hlbp.cli.bench import bench_app
from hlbp.cli.control_cmds import register as register_control_commands
from hlbp.cli.model_cmds import register as register_model_commands
from hlbp.cli.options import make_console, opt, run_app
from hlbp.cli.simulate import register as register_simulate
from hlbp.peer.common import allocator

app = typer.Typer(
    name="hlbp",
    help="Pre-train a language model together with volunteer peers over the internet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = make_console()
app.add_typer(bench_app, name="bench")
register_control_commands(app)
register_simulate(app)
register_model_commands(app)


def _version() -> str:
    try:
        return version("hlbp")
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hlbp {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """hlbp: heterogeneous low-bandwidth pre-training. Full replicas and pipeline swarms, merged by SparseLoCo."""


@app.command()
def train(
    model: str = opt("tiny", "--model", env="MODEL", help="Model preset: tiny, small, 125m, 350m, 1b."),
    steps: int = opt(300, "--steps", env="STEPS", help="Optimizer steps in total."),
    batch_size: int = opt(16, "--batch-size", env="BATCH_SIZE", help="Sequences per micro-batch."),
    seq_len: int | None = opt(None, "--seq-len", env="SEQ_LEN", help="Tokens per sequence (default: the preset's max)."),
    grad_accum: int = opt(1, "--grad-accum", env="GRAD_ACCUM", help="Micro-batches per optimizer step."),
    lr: float = opt(3e-3, "--lr", env="LR", help="Peak AdamW learning rate."),
    warmup: int = opt(30, "--warmup", env="WARMUP", help="Linear warm-up steps."),
    weight_decay: float = opt(0.1, "--weight-decay", env="WEIGHT_DECAY", help="AdamW weight decay."),
    grad_clip: float = opt(1.0, "--grad-clip", env="GRAD_CLIP", help="Max gradient norm (0 disables)."),
    data: str = opt("builtin", "--data", env="DATA", help="builtin, text/JSONL files or dirs (comma-separated), or hf:NAME."),
    vocab_size: int = opt(8192, "--vocab-size", env="VOCAB_SIZE", help="BPE vocabulary size when training one."),
    tokenizer: Path | None = opt(None, "--tokenizer", env="TOKENIZER", help="Use this tokenizer.json."),
    cache_dir: Path | None = opt(None, "--cache-dir", env="CACHE", help="Cache for corpus and tokens (default: ~/.cache/hlbp)."),
    eval_every: int = opt(50, "--eval-every", env="EVAL_EVERY", help="Steps between validation passes."),
    eval_batches: int = opt(8, "--eval-batches", env="EVAL_BATCHES", help="Validation batches per pass."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init and data order."),
    device: str = opt("auto", "--device", env="DEVICE", help="auto, cpu or cuda."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
    out_dir: Path = opt(Path("runs/train"), "--out-dir", env="OUT_DIR", help="Checkpoint and metrics directory."),
    checkpoint_every: int = opt(100, "--checkpoint-every", env="CHECKPOINT_EVERY", help="Steps between checkpoints."),
    resume: bool = opt(False, "--resume/--no-resume", env="RESUME", help="Continue from --out-dir's checkpoint."),
    progress: bool = opt(True, "--progress/--no-progress", env="PROGRESS", help="Show a progress bar."),
    recompute: bool = opt(False, "--recompute/--no-recompute", env="RECOMPUTE",
                          help="Run each block's forward again in the backward instead of holding its activations: "
                               "less memory, more compute, the same gradients."),
) -> None:
    """Train one model locally on this machine (no peers): the inner trainer on its own."""
    from hlbp.peer.train.local import LocalRunConfig, run_local_training
    from hlbp.peer.train.trainer import OptimConfig

    cfg = LocalRunConfig(
        model=model, steps=steps, batch_size=batch_size, seq_len=seq_len, data=data, vocab_size=vocab_size,
        tokenizer=tokenizer, cache_dir=cache_dir, eval_every=eval_every, eval_batches=eval_batches, seed=seed,
        device=device, threads=threads, out_dir=out_dir, checkpoint_every=checkpoint_every, resume=resume,
        progress=progress, recompute=recompute,
        optim=OptimConfig(lr=lr, warmup_steps=warmup, weight_decay=weight_decay, grad_clip=grad_clip, grad_accum=grad_accum),
    )
    run_local_training(cfg, console)


def main() -> None:
    """Console entry point: user and protocol errors become one line on stderr and exit status 2. A command that
    runs a peer starts again with jemalloc where the system has it (:mod:`hlbp.peer.common.allocator`)."""
    allocator.run_with_jemalloc()
    run_app(app, console)


if __name__ == "__main__":
    main()
