"""``hlbp bench pipeline``: one pipeline swarm over emulated WAN links per codec (and per count of peers on a slowed
stage)."""

from __future__ import annotations

from pathlib import Path

from hlbp.cli.bench import OUT_HELP, QUICK_HELP, bench_app, console
from hlbp.cli.options import opt
from hlbp.peer.common.errors import UserInputError


@bench_app.command("pipeline")
def pipeline(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP + " A PNG is written beside it."),
    stages: int = opt(3, "--stages", env="BENCH_STAGES", help="Stages of the swarm (2-4), one process each."),
    steps: int | None = opt(None, "--steps", env="BENCH_STEPS", help="Inner steps per codec (default 10; quick 6)."),
    codecs: str | None = opt(
        None, "--codecs", env="BENCH_CODECS",
        help="Comma-separated kind@k/d (default dense and subspace-a/-b/-a-drift at 1/32 and 1/128; "
        "quick dense,subspace-a@1/32).",
    ),
    micro_batches: int | None = opt(
        None, "--micro-batches", env="BENCH_MICRO_BATCHES", help="Micro-batches per step (default 16; quick 4)."
    ),
    in_flight: int | None = opt(None, "--in-flight", env="BENCH_IN_FLIGHT",
                                help="Most micro-batches in the chain at once [default: all of a step's]."),
    schedules: str = opt("uniform", "--schedules", env="BENCH_SCHEDULES",
                         help="Comma-separated micro-batch schedules of the driver (hlbp join "
                              "--micro-batch-schedule), each run per codec back to back: uniform, tapered, or both "
                              "(then their ratio is printed)."),
    batch_size: int | None = opt(None, "--batch-size", env="BENCH_BATCH_SIZE",
                                 help="Sequences per step (default 64; quick 8)."),
    wan_delay_ms: float = opt(10.0, "--wan-delay-ms", env="BENCH_WAN_DELAY_MS",
                              help="Emulated one-way delay of every link (round trip: twice this)."),
    wan_mbps: float | None = opt(None, "--wan-mbps", env="BENCH_WAN_MBPS",
                                 help="Emulated link rate, Mbit/s each way (default 1: dense bf16 is link-bound)."),
    model: str = opt("tiny", "--model", env="BENCH_MODEL", help="Model preset."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed of every run: initial weights, data order, U and T_fixed."),
    threads: int = opt(1, "--threads", env="THREADS", help="torch CPU threads per stage process."),
    cache_dir: Path | None = opt(None, "--cache-dir", env="CACHE", help="Cache for corpus and tokenizer."),
    stage_peers: str = opt("1", "--stage-peers", env="BENCH_STAGE_PEERS",
                           help="Comma-separated counts of peers on the slow stage, each run per codec back to back "
                                "(e.g. 1,2: the ratio is printed; the driver runs with hlbp join --stage-peers)."),
    slow_stage: int = opt(1, "--slow-stage", env="BENCH_SLOW_STAGE", help="The stage --slow-stage-factor slows."),
    slow_stage_factor: float = opt(1.0, "--slow-stage-factor", env="BENCH_SLOW_STAGE_FACTOR",
                                   help="How many times as long each peer of --slow-stage takes over a training "
                                        "pass (it sleeps the difference and announces that much less throughput): "
                                        "a slow device that makes that stage the bottleneck (1: none)."),
) -> None:
    """One pipeline swarm over emulated WAN links per codec: tokens/s, bytes/token, bottleneck busy, val loss."""
    import dataclasses

    from hlbp.peer.bench.pipeline import PipelineBenchConfig, run_pipeline_bench

    cfg = PipelineBenchConfig.quick() if quick else PipelineBenchConfig()
    changes: dict = {"stages": stages, "in_flight": in_flight, "wan_delay_ms": wan_delay_ms, "model": model,
                     "seed": seed, "threads": threads, "cache_dir": cache_dir, "slow_stage": slow_stage,
                     "slow_stage_factor": slow_stage_factor}
    try:
        changes["stage_peers"] = tuple(int(c) for c in stage_peers.split(",") if c.strip())
    except ValueError:
        raise UserInputError(f"--stage-peers must be comma-separated counts, got {stage_peers!r}") from None
    if codecs is not None:
        changes["codecs"] = tuple(c.strip() for c in codecs.split(",") if c.strip())
    changes["schedules"] = tuple(c.strip() for c in schedules.split(",") if c.strip())
    for name, value in (("steps", steps), ("micro_batches", micro_batches), ("batch_size", batch_size),
                        ("wan_mbps", wan_mbps)):
        if value is not None:
            changes[name] = value
    run_pipeline_bench(dataclasses.replace(cfg, **changes), out, console)
