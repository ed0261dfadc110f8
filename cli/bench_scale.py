"""``hlbp bench gather`` and ``hlbp bench scale``: what the round protocol costs as a run grows."""

from __future__ import annotations

from pathlib import Path

from hlbp.cli.bench import OUT_HELP, QUICK_HELP, bench_app, console, number_list
from hlbp.cli.options import opt
from hlbp.peer.common.errors import UserInputError
from hlbp.protocol.manifest import MAX_COMMITTEE


@bench_app.command("gather")
def gather(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    replicas: int | None = opt(None, "--replicas", env="BENCH_REPLICAS", help="Replicas N (default 32; quick 8)."),
    gathers: str = opt("", "--gathers", env="BENCH_GATHERS",
                       help="Caps F to compare, comma-separated (default 4,8,16,32; quick 2,4,8); F >= N is uncapped."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds (default 30; quick 4)."),
    jobs: int = opt(1, "--jobs", env="BENCH_JOBS", help="Runs at once, each its own process with one torch thread."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init and data."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads (with --jobs 1)."),
) -> None:
    """Loss against tokens under a capped gather set, the left-out mass kept in error feedback or dropped."""
    import dataclasses

    import torch

    from hlbp.peer.bench.gather import GatherBenchConfig, run_gather_bench

    if threads:
        torch.set_num_threads(threads)
    cfg = GatherBenchConfig.quick() if quick else GatherBenchConfig()
    changes: dict = {"seed": seed, "jobs": jobs}
    if replicas is not None:
        changes["replicas"] = replicas
    if rounds is not None:
        changes["rounds"] = rounds
    if gathers:
        changes["gathers"] = number_list(gathers, int, "--gathers")
    cfg = dataclasses.replace(cfg, **changes)
    if cfg.replicas < 2 or jobs < 1 or cfg.rounds < 1 or any(f < 1 for f in cfg.gathers):
        raise UserInputError("--replicas must be >= 2, --jobs, --rounds and every cap >= 1")
    run_gather_bench(cfg, out, console)


@bench_app.command("scale")
def scale(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK",
                      help="CI-sized: processes at N = 4 and 8 with F = 3, the simulator at N = 1000 (minutes)."),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    sizes: str = opt("", "--sizes", env="BENCH_SIZES",
                     help="Process sizes N, comma-separated (default 8,16,24; quick 4,8); empty list: none."),
    simulated: str = opt("", "--simulated", env="BENCH_SIMULATED",
                         help="Simulated sizes N, comma-separated (default 100,300,1000; quick 1000)."),
    gather: int | None = opt(None, "--gather", env="BENCH_GATHER", help="The cap F (default 8; quick 3)."),
    reserves: int | None = opt(None, "--reserves", env="BENCH_RESERVES", help="Reserves R (default 4; quick 2)."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Rounds per process run (default 5)."),
    committee: int | None = opt(None, "--committee", env="BENCH_COMMITTEE",
                                help="Committee seats W in the capped process runs (default 16; quick 6; 0: "
                                     "records all-to-all)."),
    simulated_committee: int | None = opt(None, "--simulated-committee", env="BENCH_SIMULATED_COMMITTEE",
                                          help="Committee seats W in the simulator (default 32; 0: all-to-all)."),
    workdir: Path | None = opt(None, "--workdir", env="BENCH_WORKDIR",
                               help="Keep the process runs' logs and metrics here (default: a temporary directory)."),
) -> None:
    """Payload bytes and round records per peer and round against N: real processes and the protocol simulator."""
    import dataclasses

    from hlbp.peer.bench.scale import ScaleBenchConfig, run_scale_bench

    cfg = ScaleBenchConfig.quick() if quick else ScaleBenchConfig()
    changes: dict = {"workdir": workdir}
    for name, text, flag in (("process_sizes", sizes, "--sizes"), ("simulated_sizes", simulated, "--simulated")):
        if text:
            changes[name] = number_list(text, int, flag)
    for name, value in (("gather", gather), ("reserves", reserves), ("rounds", rounds), ("committee", committee),
                        ("simulated_committee", simulated_committee)):
        if value is not None:
            changes[name] = value
    cfg = dataclasses.replace(cfg, **changes)
    if cfg.gather < 1 or cfg.reserves < 0 or cfg.rounds < 1 or any(n < 2 for n in cfg.process_sizes + cfg.simulated_sizes):
        raise UserInputError("--gather and --rounds must be >= 1, --reserves >= 0, and every size >= 2")
    if not (0 <= cfg.committee <= MAX_COMMITTEE and 0 <= cfg.simulated_committee <= MAX_COMMITTEE):
        raise UserInputError(f"--committee and --simulated-committee must be in 0..{MAX_COMMITTEE}")
    run_scale_bench(cfg, out, console)
