"""``hlbp bench ...``: benchmarks as commands. Each takes --quick (CI-sized) and --out FILE.json, prints a table."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from hlbp.cli.options import make_console, opt
from hlbp.peer.common.errors import UserInputError

bench_app = typer.Typer(help="Benchmarks: each prints a short table and writes JSON with --out.", no_args_is_help=True)
console = make_console()

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
    alphas: str = opt("", "--alphas", env="BENCH_ALPHAS",
                      help="SparseLoCo outer learning rates, comma-separated; each is a row of every SparseLoCo "
                           "setting (default 1, the reference)."),
    betas: str = opt("", "--betas", env="BENCH_BETAS",
                     help="SparseLoCo error-feedback decays in (0, 1), comma-separated, likewise (default 0.95)."),
    only: str = opt("", "--only", env="BENCH_ONLY",
                    help="Comma-separated substrings: run only methods whose label matches (the AdamW baseline "
                         "always runs, and so does DiLoCo except in --overlap)."),
    jobs: int = opt(1, "--jobs", env="BENCH_JOBS",
                    help="Methods run at once, each its own process with one torch thread (use the cores you have; "
                         "on a GPU they share it: a 16-core H100 box ran 14 at once)."),
    overlap: bool = opt(False, "--overlap", env="BENCH_OVERLAP",
                        help="Overlapped rounds in process: DiLoCo and SparseLoCo each without overlap, with a naive "
                             "one-round delay and with eager updates (30 rounds of H = 30; --quick: a smoke run)."),
    long: bool = opt(False, "--long", env="BENCH_LONG",
                     help="The long horizon: 150 rounds of H = 15, warm-up then cosine to 0.1x, a tuning sweep per "
                          "method (DiLoCo outer lr 0.6/0.7; SparseLoCo k 64/128 x inner lr 1/1.25x): 7 runs of about "
                          "16 minutes each on one core, about an hour with --jobs 2 on 2 cores; on one H100 with "
                          "--jobs 14, 14 runs took 6 minutes (under CUDA MPS). --quick: a smoke run of the same sweep."),
    noloco: bool = opt(False, "--noloco", env="BENCH_NOLOCO",
                       help="NoLoCo (pairs instead of rounds), dense and sparse (k = 64), beside DiLoCo, SparseLoCo and "
                            "the single AdamW run: 40 rounds of H = 15, the replicas' mean loss and their spread "
                            "(--quick: a smoke run)."),
    state: bool = opt(False, "--state", env="BENCH_STATE",
                      help="A peer's own state in bfloat16: SparseLoCo with float32 error feedback and AdamW moments, "
                           "with bf16 error feedback, with it and AdamW's second moment in bf16, and with both moments "
                           "in bf16, beside DiLoCo and the single AdamW run (40 rounds of H = 15; --quick: a smoke "
                           "run)."),
    stale: bool = opt(False, "--stale", env="BENCH_STALE",
                      help="Stale inner gradients, what an asynchronous pipeline schedule would apply: the single "
                           "AdamW run and SparseLoCo each with fresh gradients, one-step-stale ones and stale ones "
                           "with a weight look-ahead, beside DiLoCo (40 rounds of H = 15; --quick: a smoke run)."),
    ablations: bool = opt(False, "--ablations", env="BENCH_ABLATIONS",
                          help="--long: also the small-tensor rule (per k) and median-norm clipping against their "
                               "defaults, 3 runs more."),
    diloco_lrs: str = opt("", "--diloco-lrs", env="BENCH_DILOCO_LRS",
                          help="--long: DiLoCo's Nesterov outer learning rates to sweep, comma-separated "
                               "(default 0.6,0.7)."),
    ks: str = opt("", "--ks", env="BENCH_KS",
                  help="SparseLoCo top-k values per chunk to run, comma-separated (default: the sweep's)."),
    lr_mults: str = opt("", "--lr-mults", env="BENCH_LR_MULTS",
                        help="--long: SparseLoCo inner lr as multiples of DiLoCo's, comma-separated (default 1,1.25)."),
) -> None:
    """SparseLoCo vs DiLoCo vs one AdamW run with R x the batch, at equal tokens (--long: the long horizon;
    --noloco: NoLoCo beside them)."""
    import dataclasses

    import torch

    from hlbp.peer.bench.convergence import ConvergenceBenchConfig, run_convergence_bench

    if threads:
        torch.set_num_threads(threads)
    if long + overlap + noloco + state + stale > 1:
        raise UserInputError("--long, --overlap, --noloco, --state and --stale are separate sweeps: choose one")
    if stale:
        cfg = ConvergenceBenchConfig.stale(quick=quick)
    elif state:
        cfg = ConvergenceBenchConfig.state(quick=quick)
    elif noloco:
        cfg = ConvergenceBenchConfig.noloco(quick=quick)
    elif overlap:
        cfg = ConvergenceBenchConfig.overlap(quick=quick)
    elif long:
        cfg = ConvergenceBenchConfig.long(quick=quick)
    else:
        cfg = ConvergenceBenchConfig.quick() if quick else ConvergenceBenchConfig()
    if replicas < 1:
        raise UserInputError("--replicas must be >= 1")
    if jobs < 1:
        raise UserInputError("--jobs must be >= 1")
    if ablations and not long:
        raise UserInputError("--ablations adds rows to the --long sweep: add --long")
    changes = {"replicas": replicas, "seed": seed, "jobs": jobs, "ablations": ablations,
               "only": tuple(x.strip() for x in only.split(",") if x.strip())}
    if rounds is not None:
        changes["rounds"] = rounds
    if inner_steps is not None:
        changes["inner_steps"] = inner_steps
    for name, text, kind in (("diloco_lrs", diloco_lrs, float), ("ks", ks, int), ("lr_mults", lr_mults, float),
                             ("alphas", alphas, float), ("betas", betas, float)):
        values = number_list(text, kind, "--" + name.replace("_", "-"))
        if values:
            changes[name] = values
    if (diloco_lrs or lr_mults) and not long:
        raise UserInputError("--diloco-lrs and --lr-mults shape the --long sweep: add --long")
    run_convergence_bench(dataclasses.replace(cfg, **changes), out, console)


def number_list(text: str, kind: type, flag: str) -> tuple:
    """A comma-separated list of positive numbers (of ``kind``: int or float) from a flag, or () when it is empty;
    the ``hlbp bench`` commands share it."""
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        example = "4,8" if kind is int else "0.5,0.6"
        raise UserInputError(f"{flag} takes comma-separated numbers, e.g. {flag} {example}; got {text!r}") from None
    if any(not (v > 0 and math.isfinite(v)) for v in values):
        raise UserInputError(f"{flag}: every value must be a finite number > 0; got {text!r}")
    return values


@bench_app.command("activations")
def activations(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    stages: int = opt(4, "--stages", env="BENCH_STAGES", help="Pipeline stages (boundaries = stages - 1)."),
    train_steps: int | None = opt(
        None, "--train-steps", env="BENCH_TRAIN_STEPS", help="Inner steps under each codec first (default 10; quick 2)."
    ),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init, data, U and T_fixed."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
) -> None:
    """Per codec and k/d: bytes per token per boundary each way, encode/decode time, reconstruction error."""
    import dataclasses

    import torch

    from hlbp.peer.bench.activations import ActivationsBenchConfig, run_activations_bench

    if threads:
        torch.set_num_threads(threads)
    cfg = ActivationsBenchConfig.quick() if quick else ActivationsBenchConfig()
    changes: dict = {"stages": stages, "seed": seed}
    if train_steps is not None:
        changes["train_steps"] = train_steps
    run_activations_bench(dataclasses.replace(cfg, **changes), out, console)


@bench_app.command("heterogeneous")
def heterogeneous(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    replicas: int | None = opt(None, "--replicas", env="BENCH_REPLICAS",
                               help="Replicas R, half of them compress in 'half' (default 4; --network --quick 2)."),
    stages: int = opt(2, "--stages", env="BENCH_STAGES", help="Stages of each pipeline replica."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds (default 12; quick 2)."),
    inner_steps: int | None = opt(None, "--inner-steps", env="BENCH_INNER_STEPS", help="H (default 15; quick 4)."),
    ratios: str | None = opt(
        None, "--ratios", env="BENCH_RATIOS", help="Comma-separated k/d (default 1/8,1/32,1/128; quick 1/32)."
    ),
    variants: str | None = opt(
        None, "--variants", env="BENCH_VARIANTS",
        help="Comma-separated codecs (default subspace-a,subspace-b,subspace-a-drift).",
    ),
    wire_dtype: str | None = opt(
        None, "--wire-dtype", env="BENCH_WIRE_DTYPE", help="Activation wire dtype fp32/bf16/fp16 (default fp32)."
    ),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init, data, U and T_fixed."),
    partition: str = opt("balanced", "--partition", env="BENCH_PARTITION",
                         help="Layers per stage: balanced (as the bootstrap splits a run: the last stage, which "
                              "holds the head, takes fewer) or even."),
    threads: int | None = opt(None, "--threads", env="THREADS",
                              help="torch CPU threads (--network: per peer process, default 1)."),
    network: bool = opt(False, "--network", env="BENCH_NETWORK",
                        help="Real processes on loopback instead: all uncompressed, heterogeneous (R/2 full "
                             "replicas + R/2 compressed swarms) and all compressed, at equal tokens."),
    variant: str | None = opt(None, "--variant", env="BENCH_VARIANT",
                              help="--network: the swarms' codec (default subspace-b; subspace-a, "
                                   "subspace-a-drift)."),
    ratio: str | None = opt(None, "--ratio", env="BENCH_RATIO", help="--network: the codec's k/d (default 1/32)."),
    weighting: str | None = opt(
        None, "--weighting", env="BENCH_WEIGHTING",
        help="--network: manifest weighting equal|tokens, or both (also runs the heterogeneous arm "
             "free-running with each); default equal.",
    ),
    swarm_wan_delay_ms: float | None = opt(None, "--swarm-wan-delay-ms", env="BENCH_SWARM_WAN_DELAY_MS",
                                           help="--network: the stage peers' emulated one-way delay."),
    swarm_wan_mbps: float | None = opt(None, "--swarm-wan-mbps", env="BENCH_SWARM_WAN_MBPS",
                                       help="--network: the stage peers' emulated link rate, Mbit/s each way."),
    plot: Path | None = opt(None, "--plot", env="BENCH_PLOT",
                            help="--network: write the PNG here (default: beside --out)."),
    cache_dir: Path | None = opt(None, "--cache-dir", env="CACHE", help="--network: corpus and tokenizer cache."),
    workdir: Path | None = opt(None, "--workdir", env="BENCH_WORKDIR",
                               help="--network: keep every run's peer logs, checkpoints and metrics here."),
) -> None:
    """SparseLoCo with some replicas as compressed pipelines: variant x k/d x {none, half, all} compressed.

    With --network: the three arms on real processes (bench/hetnet.py), and the paper's claim checked."""
    import dataclasses

    import torch

    from hlbp.peer.bench.heterogeneous import HeterogeneousBenchConfig, run_heterogeneous_bench
    from hlbp.peer.model.codec import CodecConfig

    network_only = {"--variant": variant, "--ratio": ratio, "--weighting": weighting, "--plot": plot,
                    "--swarm-wan-delay-ms": swarm_wan_delay_ms, "--swarm-wan-mbps": swarm_wan_mbps,
                    "--cache-dir": cache_dir, "--workdir": workdir}
    if network:
        given = [f for f, v in {"--ratios": ratios, "--variants": variants, "--wire-dtype": wire_dtype,
                                "--partition": partition != "balanced"}.items() if v]
        if given:
            raise UserInputError(f"{', '.join(given)} belong to the in-process benchmark; with --network use "
                                 "--variant and --ratio")
        _heterogeneous_network(quick, out, replicas, stages, rounds, inner_steps, seed, threads, network_only)
        return
    given = [f for f, v in network_only.items() if v is not None]
    if given:
        raise UserInputError(f"{', '.join(given)} need --network")
    if threads:
        torch.set_num_threads(threads)
    cfg = HeterogeneousBenchConfig.quick() if quick else HeterogeneousBenchConfig()
    changes: dict = {"stages": stages, "seed": seed, "wire_dtype": wire_dtype, "partition": partition}
    if replicas is not None:
        changes["replicas"] = replicas
    if rounds is not None:
        changes["rounds"] = rounds
    if inner_steps is not None:
        changes["inner_steps"] = inner_steps
    if ratios:
        changes["ratios"] = tuple(r.strip() for r in ratios.split(",") if r.strip())
    if variants:
        changes["variants"] = tuple(v.strip() for v in variants.split(",") if v.strip())
        for v in changes["variants"]:
            CodecConfig(v)  # rejects unknown names with a clear message before any work
    run_heterogeneous_bench(dataclasses.replace(cfg, **changes), out, console)


def _heterogeneous_network(quick: bool, out: Path | None, replicas: int | None, stages: int, rounds: int | None,
                           inner_steps: int | None, seed: int, threads: int | None, flags: dict) -> None:
    """``bench heterogeneous --network``: the flags become a HetNetBenchConfig (quick: R = 2, 3 rounds)."""
    import dataclasses

    from hlbp.peer.bench.hetnet import HetNetBenchConfig, run_hetnet_bench

    cfg = HetNetBenchConfig.quick() if quick else HetNetBenchConfig()
    changes: dict = {"seed": seed, "stages": stages, "swarm_wan_delay_ms": flags["--swarm-wan-delay-ms"],
                     "swarm_wan_mbps": flags["--swarm-wan-mbps"], "cache_dir": flags["--cache-dir"],
                     "workdir": flags["--workdir"]}
    for name, value in (("replicas", replicas), ("rounds", rounds), ("inner_steps", inner_steps), ("threads", threads),
                        ("variant", flags["--variant"]), ("ratio", flags["--ratio"]),
                        ("weighting", flags["--weighting"])):
        if value is not None:
            changes[name] = value
    run_hetnet_bench(dataclasses.replace(cfg, **changes), out, flags["--plot"], console)


@bench_app.command("codec")
def codec(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    models: str | None = opt(
        None, "--models", env="BENCH_MODELS",
        help="Comma-separated presets for the real inputs (default tiny,small; quick tiny).",
    ),
    rounds: int | None = opt(
        None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds; all but the last fill EF buffers (default 2)."
    ),
    inner_steps: int | None = opt(
        None, "--inner-steps", env="BENCH_INNER_STEPS", help="H (default 15; quick 5)."
    ),
    warmup_steps: int | None = opt(
        None, "--warmup-steps", env="BENCH_WARMUP_STEPS",
        help="AdamW steps before the first round (default 20; quick 5).",
    ),
    repeats: int | None = opt(
        None, "--repeats", env="BENCH_REPEATS", help="Timed runs per row, median shown (default 3; quick 2)."
    ),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init, data and the synthetic input."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
) -> None:
    """SparseLoCo entropy and packed12 formats vs dense fp32, bf16 and zstd: bits/param, time, error."""
    import dataclasses

    import torch

    from hlbp.peer.bench.codec import CodecBenchConfig, run_codec_bench

    if threads:
        torch.set_num_threads(threads)
    cfg = CodecBenchConfig.quick() if quick else CodecBenchConfig()
    changes: dict = {"seed": seed}
    if models is not None:
        changes["models"] = tuple(m.strip() for m in models.split(",") if m.strip())
    for name, value in (("rounds", rounds), ("inner_steps", inner_steps), ("warmup_steps", warmup_steps),
                        ("repeats", repeats)):
        if value is not None:
            changes[name] = value
    run_codec_bench(dataclasses.replace(cfg, **changes), out, console)


@bench_app.command("network")
def network(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    models: str | None = opt(
        None, "--models", env="BENCH_MODELS", help="Comma-separated presets (default tiny,small; quick tiny)."
    ),
    peers: str | None = opt(
        None, "--peers", env="BENCH_PEERS", help="Comma-separated swarm sizes N (default 2,4; quick 2)."
    ),
    rounds: int | None = opt(
        None, "--rounds", env="BENCH_ROUNDS", help="Timed rounds of each method after one warm-up (default 4; quick 2)."
    ),
    k: int = opt(64, "--k", env="BENCH_K", help="SparseLoCo values kept per 4096."),
    link_mbps: float | None = opt(
        None, "--link-mbps", env="BENCH_LINK_MBPS",
        help="Link rate in Mbit/s for the physical floor; default: measure loopback through P2PBlobTransport.",
    ),
    link_probe_mib: int = opt(
        64, "--link-probe-mib", env="BENCH_LINK_PROBE_MIB", help="Size of the blob the link measurement fetches."
    ),
    matchmaking_s: float = opt(
        2.0, "--matchmaking-s", env="BENCH_MATCHMAKING_S", help="hivemind min_matchmaking_time of the dense side."
    ),
    step_timeout_s: float = opt(
        120.0, "--step-timeout-s", env="BENCH_STEP_TIMEOUT_S",
        help="Give up on one dense step or SparseLoCo round after this long (raise it for slow --shape-mbps).",
    ),
    shape_mbps: float | None = opt(
        None, "--shape-mbps", env="BENCH_SHAPE_MBPS",
        help="Root only: run in a fresh network namespace whose loopback is limited to this many Mbit/s (tc tbf), "
        "shared by all N peers; no latency emulation.",
    ),
    inside_netns: str | None = opt(
        None, "--inside-netns", env="BENCH_INSIDE_NETNS", hidden=True,
        help="Internal: set by --shape-mbps on the run it starts inside the shaped namespace.",
    ),
    seed: int = opt(0, "--seed", env="SEED", help="Seed for init and data."),
    threads: int | None = opt(None, "--threads", env="THREADS", help="torch CPU threads."),
) -> None:
    """SparseLoCo rounds on real p2pd peers vs hivemind's dense all-reduce: bytes, comm time, ratio to the floor."""
    if shape_mbps is not None and link_mbps is not None:
        raise UserInputError("give --shape-mbps or --link-mbps, not both (a shaped run's link rate is its shape)")
    import dataclasses

    import torch

    from hlbp.peer.bench.network import NetworkBenchConfig, run_network_bench
    from hlbp.peer.bench.shaping import current_netns, run_shaped

    if inside_netns is not None and (shape_mbps is None or current_netns() != inside_netns):
        raise UserInputError("--inside-netns is internal to --shape-mbps; leave it out")
    if threads:
        torch.set_num_threads(threads)
    cfg = NetworkBenchConfig.quick() if quick else NetworkBenchConfig()
    changes: dict = {"k": k, "link_mbps": link_mbps, "link_probe_mib": link_probe_mib,
                     "matchmaking_s": matchmaking_s, "step_timeout_s": step_timeout_s, "seed": seed,
                     "shaped_mbps": shape_mbps}
    if models is not None:
        changes["models"] = tuple(m.strip() for m in models.split(",") if m.strip())
    if peers is not None:
        try:
            changes["peers"] = tuple(int(p) for p in peers.split(",") if p.strip())
        except ValueError:
            raise UserInputError(f"--peers takes comma-separated integers, not {peers!r}") from None
    if rounds is not None:
        changes["rounds"] = rounds
    cfg = dataclasses.replace(cfg, **changes)
    if shape_mbps is not None and inside_netns is None:  # re-run this command inside a shaped namespace
        status = run_shaped(cfg, out, console, threads)
        if status:
            raise typer.Exit(status)
        return
    run_network_bench(cfg, out, console)


@bench_app.command("swarm")
def swarm(
    quick: bool = opt(False, "--quick", env="BENCH_QUICK", help=QUICK_HELP),
    out: Path | None = opt(None, "--out", env="BENCH_OUT", help=OUT_HELP),
    full: int | None = opt(None, "--full", env="BENCH_FULL", help="Replicas (default 4; quick 2)."),
    rounds: int | None = opt(None, "--rounds", env="BENCH_ROUNDS", help="Outer rounds (default 5; quick 2)."),
    inner_steps: int | None = opt(None, "--inner-steps", env="BENCH_INNER_STEPS", help="H (default 10; quick 5)."),
    model: str = opt("tiny", "--model", env="BENCH_MODEL", help="Model preset."),
    seed: int = opt(0, "--seed", env="SEED", help="Seed of both runs: initial weights and data order."),
    threads: int = opt(1, "--threads", env="THREADS", help="torch CPU threads per replica process."),
    cache_dir: Path | None = opt(None, "--cache-dir", env="CACHE", help="Cache for corpus and tokenizer."),
    wan_delay_ms: float = opt(0.0, "--wan-delay-ms", env="BENCH_WAN_DELAY_MS",
                              help="Emulated one-way delay in front of every peer (round trip: twice this)."),
    wan_mbps: float | None = opt(None, "--wan-mbps", env="BENCH_WAN_MBPS",
                                 help="Emulated link rate of every peer, Mbit/s each way."),
    overlap: str = opt("", "--overlap", env="BENCH_OVERLAP",
                       help="Comma-separated overlap modes (none,naive,eager): run SparseLoCo once per mode instead "
                            "of SparseLoCo against DiLoCo, and compare utilization and loss with no overlap."),
) -> None:
    """The same loopback swarm twice (hlbp simulate): SparseLoCo rounds, then hivemind's dense DiLoCo rounds; with
    --overlap, SparseLoCo once per overlap mode."""
    import dataclasses

    from hlbp.peer.bench.swarm import SwarmBenchConfig, run_swarm_bench

    cfg = SwarmBenchConfig.quick() if quick else SwarmBenchConfig()
    changes: dict = {"model": model, "seed": seed, "threads": threads, "cache_dir": cache_dir,
                     "wan_delay_ms": wan_delay_ms, "wan_mbps": wan_mbps,
                     "overlaps": tuple(m.strip() for m in overlap.split(",") if m.strip())}
    for name, value in (("full", full), ("rounds", rounds), ("inner_steps", inner_steps)):
        if value is not None:
            changes[name] = value
    run_swarm_bench(dataclasses.replace(cfg, **changes), out, console)
