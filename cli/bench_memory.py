"""``hlbp bench memory``: what each role holds per parameter it trains."""

from __future__ import annotations

from pathlib import Path

from hlbp.cli.bench import OUT_HELP, bench_app, console
from hlbp.cli.options import opt
from hlbp.peer.common.errors import UserInputError


@bench_app.command("memory")
def memory(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK",
                      help="CI-sized: the tiny model, 2 full replicas and a 2-stage swarm, 2 rounds (about a minute)."),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    presets: str = opt("", "--presets", env="BENCH_PRESETS",
                       help="Model presets to measure, comma-separated (default small,125m; quick tiny)."),
    stages: int | None = opt(None, "--stages", env="BENCH_STAGES", help="Stages of the swarm (default 4; quick 2)."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds (default 3; quick 2)."),
    overlap: str | None = opt(None, "--overlap", env="BENCH_OVERLAP",
                              help="Round overlap of the runs: none, naive or eager (default eager)."),
    state_dtype: str | None = opt(None, "--state-dtype", env="BENCH_STATE_DTYPE",
                                  help="Every peer's --state-dtype: fp32, bf16, bf16-v or bf16-all (default: hlbp join's, "
                                       "bf16)."),
    state_on_disk: bool | None = opt(None, "--state-on-disk/--state-in-memory", env="BENCH_STATE_ON_DISK",
                                     help="Every peer's --state-on-disk or --state-in-memory (default: hlbp join's, "
                                          "on disk)."),
    recompute: bool = opt(False, "--recompute/--no-recompute", env="BENCH_RECOMPUTE",
                          help="Every peer's --recompute: each block's forward run again in the backward."),
    workdir: Path | None = opt(None, "--workdir", env="BENCH_WORKDIR",
                               help="Keep the runs' logs and metrics here (default: a temporary directory)."),
) -> None:
    """Peak host (and CUDA) bytes per trained parameter of a full replica and a stage peer through real rounds."""
    import dataclasses

    from hlbp.peer.bench.memory import MemoryBenchConfig, run_memory_bench
    from hlbp.peer.model.decoder import PRESETS

    cfg = MemoryBenchConfig.quick() if quick else MemoryBenchConfig()
    changes: dict = {"workdir": workdir, "recompute": recompute}
    if presets:
        changes["presets"] = tuple(p.strip() for p in presets.split(",") if p.strip())
    for name, value in (("stages", stages), ("rounds", rounds), ("overlap", overlap), ("state_dtype", state_dtype),
                        ("state_on_disk", state_on_disk)):
        if value is not None:
            changes[name] = value
    cfg = dataclasses.replace(cfg, **changes)
    unknown = [p for p in cfg.presets if p not in PRESETS]
    if unknown or not cfg.presets:
        raise UserInputError(f"--presets must name presets of {', '.join(PRESETS)}; got {presets!r}")
    if cfg.stages < 2 or cfg.rounds < 1 or cfg.overlap not in ("none", "naive", "eager") \
            or cfg.state_dtype not in (None, "fp32", "bf16", "bf16-v", "bf16-all"):
        raise UserInputError("--stages must be >= 2, --rounds >= 1, --overlap one of none, naive, eager, "
                             "--state-dtype fp32, bf16, bf16-v or bf16-all")
    run_memory_bench(cfg, out, console)
