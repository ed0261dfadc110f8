"""``hlbp bench swarm``: the same loopback swarm twice, SparseLoCo rounds and hivemind's dense DiLoCo rounds.

Why: ``hlbp bench network`` isolates the exchange (one process, synthetic compute); this benchmark runs what a
user runs. Each method gets a bootstrap and N ``hlbp join`` processes with their own p2pd (:mod:`hlbp.peer.sim.launcher`),
the same model, data, seed and hyperparameters, one after the other, and the table compares what each round cost:
bytes per peer (measured for SparseLoCo; hivemind's all-reduce bytes are analytic, ``2(N-1)/N x 4 B x params``,
since its transport counts none), communication and waiting seconds, utilization and validation loss, with
SparseLoCo / DiLoCo ratios. Run back to back on a shared machine, seconds are noisy; bytes and losses are not.
With ``wan_delay_ms`` / ``wan_mbps`` every peer sits behind :mod:`hlbp.peer.net.wanlink`'s delaying, rate-limiting
proxy, so both methods run over the same emulated internet links.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.common.errors import RunFailed, UserInputError
from hlbp.peer.rounds.overlap import OVERLAPS

METHODS = ("sparseloco", "diloco")


@dataclass
class SwarmBenchConfig:
    """The simulated run both methods get; ``quick`` shrinks it to a CI-sized smoke run."""

    full: int = 4  # replicas
    rounds: int = 5
    inner_steps: int = 10
    model: str = "tiny"
    batch_size: int = 4
    seq_len: int = 64
    seed: int = 0
    threads: int = 1  # torch threads per replica process
    timeout_s: float = 900.0  # per method
    wan_delay_ms: float = 0.0  # emulated one-way delay in front of every peer (hlbp.peer.net.wanlink)
    wan_mbps: float | None = None  # emulated per-peer link rate, each direction
    cache_dir: Path | None = None
    overlaps: tuple[str, ...] = ()  # instead of SparseLoCo vs DiLoCo: SparseLoCo once per overlap mode

    @classmethod
    def quick(cls, **overrides: Any) -> SwarmBenchConfig:
        """2 replicas, 2 rounds of 5 inner steps."""
        return dataclasses.replace(cls(full=2, rounds=2, inner_steps=5), **overrides)

    def check(self) -> None:
        if self.wan_delay_ms < 0 or self.wan_mbps is not None and self.wan_mbps <= 0:
            raise UserInputError("--wan-delay-ms must be >= 0 and --wan-mbps > 0")
        if any(m not in OVERLAPS for m in self.overlaps) or len(set(self.overlaps)) < len(self.overlaps):
            raise UserInputError("--overlap takes distinct modes among none, naive and eager")
        if self.full < 2 or self.rounds < 1 or self.inner_steps < 1 or self.threads < 1:
            raise UserInputError("--full must be >= 2 (an exchange needs two), --rounds and --inner-steps >= 1")


def method_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers the comparison needs from one :func:`hlbp.peer.sim.launcher.run_simulation` report."""
    rounds = report["rounds"]
    n = max(1, len(rounds))
    vals = [v for v in report["val_loss"] if v is not None]
    return {
        "rounds_completed": report["rounds_completed"],
        "final_val_loss": vals[-1] if vals else None,
        "val_loss": report["val_loss"],
        "states_agree": all(report["states_agree"]),
        "bit_identical": all(report["checksums_equal"]),
        "bytes_sent_per_peer_round": report["bytes_per_peer_round"]["sent"],
        "bytes_received_per_peer_round": report["bytes_per_peer_round"]["received"],
        "comm_s_per_round": report["time_s"]["comm"] / n,
        "phases_s_per_round": report.get("phases_s", {}),
        "wait_s_per_round": report["time_s"]["wait"] / n,
        "compute_s_per_round": report["time_s"]["compute"] / n,
        "utilization": report["utilization"],
        "seconds": report["seconds"],
        "landing": report.get("landing"),
    }


def compare(sparse: dict[str, Any], dense: dict[str, Any]) -> dict[str, float | None]:
    """SparseLoCo / DiLoCo ratios of bytes and communication seconds (None where a side has no value)."""

    def ratio(key: str) -> float | None:
        a, b = sparse.get(key), dense.get(key)
        return a / b if a is not None and b else None

    return {"bytes_sent": ratio("bytes_sent_per_peer_round"), "bytes_received": ratio("bytes_received_per_peer_round"),
            "comm_s": ratio("comm_s_per_round"), "val_loss": ratio("final_val_loss")}


def overlap_comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Each overlap mode against no overlap: final loss ratio, utilization, and comm + wait seconds per round."""
    base = results.get("sparseloco overlap none")
    out: dict[str, Any] = {}
    for label, r in results.items():
        row = {"utilization": r["utilization"], "comm_wait_s": r["comm_s_per_round"] + r["wait_s_per_round"]}
        if base is not None and base["final_val_loss"] and r["final_val_loss"] is not None:
            row["val_loss_vs_none"] = r["final_val_loss"] / base["final_val_loss"]
        out[label.removeprefix("sparseloco overlap ")] = row
    return out


def run_swarm_bench(cfg: SwarmBenchConfig, out: Path | None, console: Console) -> dict[str, Any]:
    """Run the swarm with each method (or each overlap mode), print the side-by-side table, and write JSON when
    ``out`` is set."""
    from hlbp.peer.sim.launcher import SimConfig
    from hlbp.peer.sim.run import run_simulation

    cfg.check()
    runs = ([(f"sparseloco overlap {m}", "sparseloco", m) for m in cfg.overlaps] if cfg.overlaps
            else [(method, method, "none") for method in METHODS])
    results: dict[str, Any] = {}
    for label, method, overlap in runs:
        sim = SimConfig(n_full=cfg.full, rounds=cfg.rounds, model=cfg.model, inner_steps=cfg.inner_steps,
                        batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, threads=cfg.threads,
                        outer=method, run_id=f"bench-swarm-{method}-{overlap}", cache_dir=cfg.cache_dir,
                        wan_delay_ms=cfg.wan_delay_ms, wan_mbps=cfg.wan_mbps, overlap=overlap)
        with tempfile.TemporaryDirectory(prefix=f"hlbp-bench-swarm-{method}-") as work:
            console.print(f"[bold]{label}[/]: {cfg.full} replicas x {cfg.rounds} rounds of {cfg.model}")
            report = run_simulation(sim, Path(work), cfg.timeout_s)
        if report["rounds_completed"] < cfg.rounds:
            raise RunFailed(f"{label}: only {report['rounds_completed']} of {cfg.rounds} rounds completed "
                            f"(exit codes {report['exit_codes']})")
        results[label] = {**method_summary(report), "wan": report.get("wan"), "overlap": overlap}
    rows = []
    for label, r in results.items():
        rows.append([label, r["final_val_loss"], r["bytes_sent_per_peer_round"] / 1e3,
                     r["bytes_received_per_peer_round"] / 1e3, r["comm_s_per_round"], r["wait_s_per_round"],
                     r["utilization"], "bit-exact" if r["bit_identical"] else ("fp rounding" if r["states_agree"]
                                                                              else "NO")])
    extra: dict[str, Any] = {}
    if cfg.overlaps:
        extra["overlap"] = overlap_comparison(results)
    else:
        ratios = compare(results["sparseloco"], results["diloco"])
        extra["sparse_over_dense"] = ratios
        rows.append(["sparse / dense", ratios["val_loss"], ratios["bytes_sent"], ratios["bytes_received"],
                     ratios["comm_s"], "", "", ""])
    print_table(Console(file=console.file, width=max(console.width, 120)),
                f"swarm on loopback: {cfg.full} x {cfg.model}, {cfg.rounds} rounds, H={cfg.inner_steps}"
                + ("" if not (cfg.wan_delay_ms or cfg.wan_mbps) else
                   f"; emulated WAN: RTT {2 * cfg.wan_delay_ms:.0f} ms, "
                   + (f"{cfg.wan_mbps:g} Mbit/s per peer" if cfg.wan_mbps else "unlimited rate")),
                ["method", "val loss", "kB sent/peer/round", "kB recv/peer/round", "comm s/round", "wait s/round",
                 "utilization", "replicas agree"], rows)
    for label, r in results.items():
        if r["phases_s_per_round"]:
            console.print(f"{label}, seconds per peer and round by step: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_s_per_round"].items()))
    if cfg.overlaps:
        for mode, row in extra["overlap"].items():
            console.print(f"overlap {mode}: utilization {row['utilization']:.1%}, comm + wait "
                          f"{row['comm_wait_s']:.2f} s per round"
                          + (f", final val loss / none {row['val_loss_vs_none']:.4f}" if "val_loss_vs_none" in row
                             else ""))
        for label, r in results.items():
            land = r.get("landing") or {}
            if land.get("mean_steps") is not None:
                console.print(f"{label}: the round's result landed mid-phase in {land['mid_phase']:.0%} of peer "
                              f"rounds, on average after {land['mean_steps']:.1f} of {cfg.inner_steps} inner steps")
            if land.get("first_partial_steps") is not None:
                console.print(f"{label}: a partial result (the contributions fetched so far) landed first in "
                              f"{land['partial']:.0%} of peer rounds, on average after "
                              f"{land['first_partial_steps']:.1f} steps")
    else:
        console.print("DiLoCo bytes are analytic (2(N-1)/N x 4 B x params per member); SparseLoCo bytes are counted.")
    return write_result(out, "swarm", dataclasses.asdict(cfg), {"methods": results, **extra})
