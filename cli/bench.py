"""``hlbp bench ...``: benchmarks as commands. Each takes --quick (CI-sized) and --out FILE.json, prints a table."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from hlbp.cli.options import opt

bench_app = typer.Typer(help="Benchmarks: each prints a short table and writes JSON with --out.", no_args_is_help=True)
console = Console(stderr=True)

QUICK_HELP = "CI-sized smoke run (well under 2 minutes)."
OUT_HELP = "Write the full result as JSON here."


@bench_app.command("convergence")
def convergence(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    replicas: int = opt(4, "--replicas", env="BENCH_REPLICAS", help="Replicas R."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds (default 12; quick 3)."),
    inner_steps: int | None = opt(None, "--inner-steps", env="BENCH_INNER_STEPS", help="H (default 15; quick 5)."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init and data."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
) -> None:
    """SparseLoCo (k = 32/64/128, both aggregation modes) vs DiLoCo vs one AdamW run, at equal tokens."""
    import dataclasses

    import torch

    from hlbp.peer.bench.convergence import ConvergenceBenchConfig, run_convergence_bench

    if threads:
        torch.set_num_threads(threads)
    cfg = ConvergenceBenchConfig.quick() if quick else ConvergenceBenchConfig()
    changes = {"replicas": replicas, "seed": seed}
    if rounds is not None:
        changes["rounds"] = rounds
    if inner_steps is not None:
        changes["inner_steps"] = inner_steps
    run_convergence_bench(dataclasses.replace(cfg, **changes), out, console)
