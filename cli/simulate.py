"""``hlbp simulate``: a whole swarm of full replicas on loopback, with a live table and a summary report.

A thin shell over :mod:`hlbp.peer.sim.launcher`: flags (each also an ``HLBP_*`` variable) become a SimConfig, the
peers' metrics feed a rich live table, and the report is printed and optionally written as JSON.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.live import Live
from rich.table import Table

from hlbp.cli.options import make_console, opt
from hlbp.peer.common.errors import UserInputError

console = make_console()


def progress_table(records: dict[str, list[dict[str, Any]]], rounds: int) -> Table:
    """One row per replica: the last round it finished, its validation loss, and whether it was accepted."""
    table = Table(title="hlbp simulate", title_justify="left")
    for col in ("peer", "round", "val loss", "ours", "in sync", "sent B", "recv B"):
        table.add_column(col, justify="left" if col == "peer" else "right")
    for name, recs in records.items():
        if not recs:
            table.add_row(name, f"0/{rounds}", "-", "starting", "-", "-", "-")
            continue
        last = recs[-1]
        ours = "accepted" if last.get("accepted") else ("left out" if last.get("contributed") else "weight 0")
        val = last.get("val_loss")
        table.add_row(name, f"{len(recs)}/{rounds}", f"{val:.4f}" if val is not None else "-", ours,
                      "yes" if last.get("in_sync", True) else "no", f"{last['bytes_sent']:,}",
                      f"{last['bytes_received']:,}")
    return table


def summary_table(report: dict[str, Any]) -> Table:
    """Per round: members, validation loss, checksum agreement, bytes and the time split."""
    table = Table(title=f"{report['rounds_completed']} rounds completed", title_justify="left")
    dense = report.get("config", {}).get("outer") == "diloco"
    agree_col = "states agree" if dense else "checksums equal"
    swarms = any(r.get("swarm_val_loss") or any(n.startswith("sw") for n in r["bytes_sent"]) for r in report["rounds"])
    val_cols = ("full val", "swarm val") if swarms else ("val loss",)
    for col in ("round", "members", *val_cols, agree_col, "sent B/peer", "recv B/peer", "compute s",
                "comm s", "wait s", "utilization"):
        table.add_column(col, justify="right")
    for r in report["rounds"]:
        sent, recv = r["bytes_sent"].values(), r["bytes_received"].values()
        util = r["utilization"]
        if swarms:
            full = r.get("full_val_loss")
            vals = [f"{full:.4f}" if full is not None else "-",
                    " ".join(f"{v:.4f}" for v in r.get("swarm_val_loss", {}).values()) or "-"]
        else:
            vals = [f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"]
        table.add_row(
            str(r["round"]), str(r["members"]), *vals,
            ("yes" if r["checksums_equal"] else "to fp rounding" if r["states_agree"] else "[red]NO[/]"), f"{sum(sent) / len(sent):,.0f}",
            f"{sum(recv) / len(recv):,.0f}", f"{r['compute_s']:.2f}", f"{r['comm_s']:.2f}", f"{r['wait_s']:.2f}",
            f"{util:.1%}" if util is not None else "-",
        )
    return table


def simulate(
    full: int = opt(4, "--full", env="SIM_FULL", help="Full replicas to start on loopback."),
    swarms: int = opt(0, "--swarms", env="SIM_SWARMS",
                      help="Pipeline swarms to start beside the full replicas, each of --stages stage peers; every "
                           "stage peer contributes its own shard to the same SparseLoCo rounds."),
    stages: int = opt(2, "--stages", env="SIM_STAGES",
                      help="Stages of the run's partition: the shards of every round, and the stage peers per swarm."),
    codec: str = opt("dense", "--codec", env="SIM_CODEC",
                     help="Activation codec of the swarms' stage boundaries: dense, subspace-a, subspace-b or "
                          "subspace-a-drift (full replicas never compress activations)."),
    codec_k: int = opt(0, "--codec-k", env="SIM_CODEC_K", help="Rank k of a subspace codec (0: d/32)."),
    micro_batches: int = opt(2, "--micro-batches", env="SIM_MICRO_BATCHES",
                             help="Micro-batches per inner step of each swarm's driver."),
    rounds: int = opt(5, "--rounds", env="SIM_ROUNDS", help="Outer rounds every replica runs."),
    model: str = opt("tiny", "--model", env="SIM_MODEL", help="Model preset of the simulated run."),
    inner_steps: int = opt(10, "--inner-steps", env="SIM_INNER_STEPS", help="Inner steps per round (H)."),
    batch_size: int = opt(4, "--batch-size", env="SIM_BATCH_SIZE", help="Sequences per inner step."),
    seq_len: int = opt(64, "--seq-len", env="SIM_SEQ_LEN", help="Tokens per sequence."),
    deadline: float = opt(5.0, "--deadline", env="SIM_DEADLINE", help="First round's collection window (s)."),
    threads: int = opt(1, "--threads", env="SIM_THREADS", help="torch CPU threads per peer."),
    seed: int = opt(0, "--seed", env="SIM_SEED", help="Seed of the run: initial weights and data order."),
    outer: str = opt("sparseloco", "--outer", env="SIM_OUTER",
                     help="Outer step: sparseloco (sparse rounds), or diloco (dense rounds through hivemind's stock "
                          "DecentralizedAverager, the baseline)."),
    aggregation: str = opt("selectors", "--aggregation", env="SIM_AGGREGATION",
                           help="SparseLoCo aggregation: selectors (mean over the replicas that chose a value) or "
                                "mean (1/R, zero where not chosen)."),
    clip: bool = opt(True, "--clip/--no-clip", env="SIM_CLIP",
                     help="Median-norm clipping of contributions (the hostile-peer defence)."),
    small_tensors: str = opt("topk", "--small-tensors", env="SIM_SMALL_TENSORS",
                             help="SparseLoCo's 1-D and sub-chunk tensors: topk (the run's k) or dense (every "
                                  "value, 2-bit)."),
    overlap: str = opt("", "--overlap", env="SIM_OVERLAP",
                       help="Overlap each round's exchange with the next inner phase: none, naive (one round late) "
                            "or eager (one round late, plus each peer's own latest contribution). Full replicas "
                            "only; stage peers run their rounds in turn. Default: the outer's (eager for "
                            "sparseloco, none for diloco)."),
    wan_delay_ms: float = opt(0.0, "--wan-delay-ms", env="SIM_WAN_DELAY_MS",
                              help="Emulate a WAN: every peer sits behind a proxy that delays each direction by "
                                   "this many ms (round trip: twice this)."),
    wan_mbps: float = opt(None, "--wan-mbps", env="SIM_WAN_MBPS",
                          help="Emulate a WAN: each peer's link carries at most this many Mbit/s each way."),
    swarm_wan_delay_ms: float = opt(None, "--swarm-wan-delay-ms", env="SIM_SWARM_WAN_DELAY_MS",
                                    help="The stage peers' one-way delay, when it differs from --wan-delay-ms."),
    swarm_wan_mbps: float = opt(None, "--swarm-wan-mbps", env="SIM_SWARM_WAN_MBPS",
                                help="The stage peers' link rate, when it differs from --wan-mbps (weak peers "
                                     "sit behind slower links)."),
    timeout: float = opt(600.0, "--timeout", env="SIM_TIMEOUT", help="Stop everything after this many seconds."),
    workdir: Path = opt(None, "--workdir", env="SIM_WORKDIR",
                        help="Logs, keys, checkpoints and metrics of the peers (default: a new temporary directory)."),
    cache_dir: Path = opt(None, "--cache-dir", env="CACHE", help="Cache for corpus and tokenizer [~/.cache/hlbp]."),
    out: Path = opt(None, "--out", env="SIM_OUT", help="Also write the report as JSON to this file."),
    fork: bool = opt(True, "--fork/--no-fork", env="SIM_FORK",
                     help="Fork every process from one interpreter that imported torch and hivemind once (a "
                          "zygote; 3-7 CPU-s less per process); --no-fork starts each as a fresh interpreter."),
    quick: bool = opt(False, "--quick/--no-quick", env="SIM_QUICK",
                      help="A fast smoke run: 2 replicas, 2 rounds, 5 inner steps."),
) -> None:
    """Start a bootstrap, N full replicas and M pipeline swarms on 127.0.0.1, run R outer rounds, and report.

    Full replicas contribute every shard, stage peers their own stage's shard, to the same SparseLoCo rounds;
    only the swarms' stage boundaries compress activations (--codec).

    The report shows the validation loss per round, whether every peer ended each round with the same parameter
    checksums, the bytes each peer sent and received, the round time split into compute, communication and
    waiting, and the dense fp32 bytes the same exchange would have needed. Every process is stopped at the end,
    also on Ctrl-C.
    """
    from hlbp.peer.sim.launcher import SimConfig, run_simulation
    from hlbp.protocol.records import ActivationCodec, Hyperparameters

    if quick:
        full, rounds, inner_steps = 2, 2, 5
    if wan_delay_ms < 0 or wan_mbps is not None and wan_mbps <= 0:
        raise UserInputError("--wan-delay-ms must be >= 0 and --wan-mbps > 0")
    if outer not in ("sparseloco", "diloco"):
        raise UserInputError(f"--outer must be sparseloco or diloco, got {outer!r}")
    if aggregation not in ("selectors", "mean"):
        raise UserInputError(f"--aggregation must be selectors or mean, got {aggregation!r}")
    if overlap and overlap not in Hyperparameters.OVERLAPS:
        raise UserInputError(f"--overlap must be none, naive or eager, got {overlap!r}")
    if overlap not in ("", "none") and outer != "sparseloco":
        raise UserInputError("--overlap works with --outer sparseloco only")
    if overlap not in ("", "none") and codec in ActivationCodec.CONSTRAINED:
        raise UserInputError(f"--codec {codec} trains constrained full replicas, which do not overlap yet; "
                             "leave --overlap out or set it to none")
    # "" leaves it to the manifest: the outer's default, none for a variant-A codec (records.Hyperparameters)
    mode = overlap or Hyperparameters.default_overlap(outer, codec in ActivationCodec.CONSTRAINED)
    if small_tensors not in Hyperparameters.SMALL_TENSORS:
        raise UserInputError(f"--small-tensors must be topk or dense, got {small_tensors!r}")
    if full < 0 or swarms < 0 or full + swarms < 1:
        raise UserInputError("--full and --swarms must be >= 0, and together start at least one peer")
    if swarms and outer != "sparseloco":
        raise UserInputError("pipeline swarms take part in sparseloco rounds only; use --outer sparseloco")
    if stages < 1 or swarms and stages < 2:
        raise UserInputError("--stages must be >= 1, and >= 2 for pipeline swarms")
    for flag, value in (("--swarm-wan-delay-ms", swarm_wan_delay_ms), ("--swarm-wan-mbps", swarm_wan_mbps)):
        if value is not None and (value < 0 or flag.endswith("mbps") and value <= 0):
            raise UserInputError(f"{flag} must be positive")
    if rounds < 1 or inner_steps < 1 or batch_size < 1 or seq_len < 2 or threads < 1 or micro_batches < 1:
        raise UserInputError("--rounds, --inner-steps, --batch-size, --micro-batches and --threads must be >= 1")
    cfg = SimConfig(n_full=full, rounds=rounds, model=model, inner_steps=inner_steps, batch_size=batch_size,
                    seq_len=seq_len, round_deadline_s=deadline, min_deadline_s=min(1.0, deadline),
                    max_deadline_s=max(30.0, deadline), seed=seed, outer=outer, threads=threads, cache_dir=cache_dir,
                    aggregation=aggregation, clip_median=clip, small_tensors=small_tensors, overlap=overlap,
                    wan_delay_ms=wan_delay_ms, wan_mbps=wan_mbps, n_stages=stages, n_swarms=swarms,
                    micro_batches=micro_batches, codec=codec, codec_k=codec_k,
                    swarm_wan_delay_ms=swarm_wan_delay_ms, swarm_wan_mbps=swarm_wan_mbps, fork=fork)
    work = workdir or Path(tempfile.mkdtemp(prefix="hlbp-simulate-"))
    who = f"{full} full replicas" + (f" and {swarms} pipeline swarms of {stages} stage peers" if swarms else "")
    console.print(f"simulating {who} x {rounds} {outer} rounds of {model} on 127.0.0.1 (overlap {mode}); logs "
                  f"in {work}")
    with Live(progress_table({}, rounds), console=console, refresh_per_second=2) as live:
        report = run_simulation(cfg, work, timeout,
                                on_progress=lambda recs: live.update(progress_table(recs, rounds)))
    out_console = make_console(stderr=False)
    dense = outer == "diloco"
    out_console.print(summary_table(report))
    t = report["time_s"]
    util = report["utilization"]
    out_console.print(f"rounds completed: {report['rounds_completed']}/{rounds}"
                      + ("  [red](timed out)[/]" if report["timed_out"] else "")
                      + f"; checksums equal after every round: {all(report['checksums_equal'])}"
                      + (f"; states agree to float rounding: {all(report['states_agree'])}" if dense else ""))
    out_console.print(f"time per round and peer: compute {t['compute'] / max(1, len(report['rounds'])):.2f} s, "
                      f"comm {t['comm'] / max(1, len(report['rounds'])):.2f} s, "
                      f"wait {t['wait'] / max(1, len(report['rounds'])):.2f} s; "
                      f"utilization {util:.1%}" if util is not None else "no rounds finished")
    rs = report["rounds"]
    if rs and any(r.get("swarm_val_loss") for r in rs):
        first, last = rs[0], rs[-1]
        parts = []
        if first.get("full_val_loss") is not None and last.get("full_val_loss") is not None:
            parts.append(f"full replicas {first['full_val_loss']:.4f} -> {last['full_val_loss']:.4f}")
        for name in last.get("swarm_val_loss", {}):
            seen = [r["swarm_val_loss"][name] for r in rs if name in r.get("swarm_val_loss", {})]
            parts.append(f"swarm driven by {name} {seen[0]:.4f} -> {seen[-1]:.4f}")
        util = last.get("utilization_by_role", {})
        out_console.print("validation loss: " + "; ".join(parts) + "; utilization by role: "
                          + ", ".join(f"{k} {v:.0%}" for k, v in util.items() if v is not None))
    bpr = report["bytes_per_peer_round"]
    if report.get("n_params"):
        ratio = report["compression_ratio"]
        out_console.print(f"bytes per peer and round: sent {bpr['sent']:,.0f}, received {bpr['received']:,.0f}; "
                          f"dense fp32 equivalent {report['dense_fp32_bytes_per_peer_round']:,} "
                          f"({report['n_params']:,} params x 4 B) = "
                          + ("n/a" if not ratio else f"{ratio:,.2f}x the all-reduce's bytes (analytic: "
                             "2(N-1)/N x 4 B x params per member)" if dense else
                             f"{ratio:,.0f}x the measured SparseLoCo bytes"))
        if not dense and report.get("allreduce_ratio"):
            out_console.print(f"a dense fp32 all-reduce among {max(r['members'] for r in report['rounds'])} replicas "
                              f"(hlbp simulate --outer diloco) moves {report['dense_allreduce_bytes_per_peer_round']:,}"
                              f" B per peer each way: {report['allreduce_ratio']:,.0f}x the SparseLoCo traffic")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1), encoding="utf-8")
        out_console.print(f"report written to {out}")
    if report["rounds_completed"] < rounds or not all(report["states_agree"]):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``simulate`` to the ``hlbp`` app."""
    app.command()(simulate)
