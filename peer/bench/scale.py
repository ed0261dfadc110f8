"""``hlbp bench scale``: what a round costs each peer as the run grows, under a capped gather set.

Two modes, side by side in one JSON (``runs``, one entry per mode and N):

* **processes**: real ``hlbp join`` replicas of the tiny model on loopback (``hlbp simulate``'s launcher), a
  bootstrap and N full replicas, one torch thread each, with the manifest's ``gather`` = F. Counted by the peers
  themselves: payload bytes received and sent, and round records received (pushed to them or returned by their
  DHT reads, repeats included) and pushed, per peer and round; every round's checksums per shard.
* **simulated**: the protocol simulator (:mod:`hlbp.peer.sim.protocol`) at N = 100 to 1000 with churn.

Beside them, ``costs``: the CPU seconds a round's apply takes at the ``1b`` preset's sizes for F contributions
(:mod:`hlbp.peer.bench.costs`), which a cap bounds whatever N is.

The smallest process size also runs uncapped, the protocol as it was, so the table shows what the cap changes.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hlbp.peer.bench.costs import apply_costs
from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.sim.launcher import SimConfig
from hlbp.peer.sim.protocol import ProtocolSimConfig, simulate_protocol
from hlbp.peer.sim.run import run_simulation


@dataclass(frozen=True)
class ScaleBenchConfig:
    """The sizes of each mode, the cap F and its reserves R, and the rounds each run takes."""

    process_sizes: tuple[int, ...] = (8, 16, 24)
    simulated_sizes: tuple[int, ...] = (100, 300, 1000)
    gather: int = 8
    reserves: int = 4
    rounds: int = 5  # process runs
    inner_steps: int = 4
    batch_size: int = 2
    seq_len: int = 32
    deadline_s: float = 10.0  # the first collection window; later ones adapt
    committee: int = 16  # W seats in capped process runs (0: round records all-to-all)
    simulated_committee: int = 32  # W seats in the simulator
    simulated_rounds: int = 30
    churn: float = 0.1  # simulated: the share of peers that leave, and of new ones that join, each round
    seed: int = 0
    timeout_s: float = 900.0  # per process run
    workdir: Path | None = None
    uncapped_baseline: bool = True
    cost_sizes: tuple[int, ...] = (8, 16)  # contributions per round whose apply CPU is measured at 1b sizes

    @classmethod
    def quick(cls, **overrides: Any) -> ScaleBenchConfig:
        """CI-sized: processes at N = 4 and 8 with F = 3 (the cap binds at both) and W = 6, 4 rounds (the last two
        with a committee); the simulator at N = 1000 for 10 rounds."""
        base = cls(process_sizes=(4, 8), simulated_sizes=(1000,), gather=3, reserves=2, rounds=4,
                   simulated_rounds=10, uncapped_baseline=False, cost_sizes=(3,), committee=6)
        return dataclasses.replace(base, **overrides)


def process_run(cfg: ScaleBenchConfig, n: int, gather: int, workdir: Path) -> dict[str, Any]:
    """N real replicas for ``cfg.rounds`` rounds under the cap ``gather`` (0: uncapped, and no committee); the run's
    entry. With a committee, rounds 0 and 1 go all-to-all (a committee is drawn from round r - 2's members): the
    records are counted over the rounds from 2 on, beside ``records_all_rounds``."""
    committee = cfg.committee if gather else 0
    sim = SimConfig(n_full=n, rounds=cfg.rounds, inner_steps=cfg.inner_steps, batch_size=cfg.batch_size,
                    seq_len=cfg.seq_len, round_deadline_s=cfg.deadline_s, min_deadline_s=min(2.0, cfg.deadline_s),
                    max_deadline_s=max(30.0, cfg.deadline_s), seed=cfg.seed, threads=1,
                    run_id=f"scale-{n}-{gather}", gather=gather, reserves=cfg.reserves if gather else 0,
                    committee=committee, startup_timeout_s=300.0)
    report = run_simulation(sim, workdir, cfg.timeout_s)
    rounds = report["rounds"]
    total = report.get("time_s", {})
    compute, comm = total.get("compute", 0.0), total.get("comm", 0.0)
    counted = [c for r in rounds if not committee or r["round"] >= 2 for c in r.get("records_received", {}).values()]
    # from round 2: in rounds 0 and 1 peers that started late load the state from the others (megabytes served)
    sent = [b for r in rounds if r["round"] >= 2 for b in r.get("bytes_sent", {}).values()]
    return {
        "mode": "processes", "n": n, "gather": gather, "reserves": sim.reserves, "committee": committee,
        "recv_bytes_per_peer_round": report["bytes_per_peer_round"]["received"],
        "sent_bytes_per_peer_round": report["bytes_per_peer_round"]["sent"],
        "max_sent_bytes_one_peer_round": max(sent, default=0),
        "records_per_peer_round": sum(counted) / len(counted) if counted else 0.0,
        "max_records_one_peer_round": max(counted, default=0),
        "records_all_rounds": report["records_per_peer_round"]["received"],
        "records_sent_per_peer_round": report["records_per_peer_round"]["sent"],
        "rounds": len(rounds),
        "rounds_agreed": sum(1 for r in rounds if r["checksums_equal"] and r["in_sync"]),
        "accepted_per_round": [r["members"] for r in rounds],
        "utilization": compute / (compute + comm) if compute + comm > 0 else None,
        "wall_s": report.get("seconds"),
    }


def simulated_run(cfg: ScaleBenchConfig, n: int, trees: bool = True) -> dict[str, Any]:
    """The protocol simulator at N peers (``trees`` off: every peer fetches each payload from a random member, the
    baseline the fetch trees replace); the run's entry."""
    committee = cfg.simulated_committee
    res = simulate_protocol(ProtocolSimConfig(n=n, rounds=cfg.simulated_rounds, gather=cfg.gather,
                                              reserves=cfg.reserves, churn=cfg.churn, seed=cfg.seed,
                                              committee=committee, trees=trees))
    return {"mode": "simulated" if trees else "simulated, members serve", "n": n, "gather": cfg.gather,
            "reserves": cfg.reserves, "committee": committee, **res}


def write_plot(path: Path, runs: list[dict[str, Any]], title: str) -> bool:
    """Payload bytes and round records received per peer and round against N; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = sorted({(r["mode"], r["gather"], r.get("committee") or 0) for r in runs})
    for mode, gather, seats in groups:
        pts = sorted((r["n"], r) for r in runs if (r["mode"], r["gather"], r.get("committee") or 0) == (mode, gather, seats))
        label = f"{mode}, " + (f"F={gather}" if gather else "uncapped") + (f", W={seats}" if seats else ", all-to-all")
        style = "o-" if mode == "processes" else "s--"
        a.plot([n for n, _ in pts], [r["recv_bytes_per_peer_round"] / 1e3 for _, r in pts], style, label=label)
        b.plot([n for n, _ in pts], [r["records_per_peer_round"] for _, r in pts], style, label=label)
    # all-to-all for reference: every peer fetches every other's payload, of the size the uncapped run measured
    base = [r for r in runs if r["mode"] == "processes" and not r["gather"] and r["n"] > 1]
    if base:
        payload = base[0]["recv_bytes_per_peer_round"] / (base[0]["n"] - 1)
        ns = sorted({r["n"] for r in runs})
        a.plot(ns, [(n - 1) * payload / 1e3 for n in ns], ":", color="grey", label="all-to-all, N - 1 payloads")
        b.plot(ns, [2 * (n - 1) for n in ns], ":", color="grey", label="all-to-all, 2 (N - 1) pushes at least")
    a.set_ylabel("payload KB received per peer and round")
    b.set_ylabel("round records received per peer and round")
    for ax in (a, b):
        ax.set_xlabel("peers N")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_scale_bench(cfg: ScaleBenchConfig, out: Path | None = None,
                    console: Console | None = None) -> dict[str, Any]:
    """Every process size (and the uncapped baseline at the smallest), then every simulated size; prints the
    table, writes JSON (after each run) and the plot."""
    console = console or Console(stderr=True)
    runs: list[dict[str, Any]] = []
    arms = [(n, cfg.gather) for n in cfg.process_sizes]
    if cfg.uncapped_baseline and cfg.process_sizes:
        arms.insert(0, (min(cfg.process_sizes), 0))
    config = dataclasses.asdict(cfg)
    with tempfile.TemporaryDirectory(prefix="hlbp-scale-") as tmp:
        base = cfg.workdir or Path(tmp)
        for n, gather in arms:
            console.print(f"processes: N={n}, " + (f"F={gather}" if gather else "uncapped"))
            workdir = base / f"n{n}-f{gather}"
            workdir.mkdir(parents=True, exist_ok=True)
            runs.append(process_run(cfg, n, gather, workdir))
            write_result(out, "scale", config, {"runs": runs, "complete": False})
    for n in cfg.simulated_sizes:
        console.print(f"simulated: N={n}")
        runs.append(simulated_run(cfg, n))
        write_result(out, "scale", config, {"runs": runs, "complete": False})
    if cfg.simulated_sizes:  # side by side at the largest size: the same run with the members serving every payload
        runs.append(simulated_run(cfg, max(cfg.simulated_sizes), trees=False))
        write_result(out, "scale", config, {"runs": runs, "complete": False})
    rows = [[r["mode"], r["n"], r["gather"] or "-", r.get("committee") or "-", int(r["recv_bytes_per_peer_round"]),
             int(r["sent_bytes_per_peer_round"]), int(r.get("max_sent_bytes_one_peer_round", 0)),
             round(r["records_per_peer_round"], 1),
             r.get("max_records_one_peer_round", "-"), f"{r['rounds_agreed']}/{r['rounds']}",
             r.get("utilization") if r.get("utilization") is not None else "-"]
            for r in runs]
    title = (f"scale: tiny model, F={cfg.gather}, R={cfg.reserves}; processes {cfg.rounds} rounds of "
             f"H={cfg.inner_steps} (W={cfg.committee}); simulated {cfg.simulated_rounds} rounds, churn {cfg.churn:.0%} "
             f"(W={cfg.simulated_committee})")
    print_table(console, title, ["mode", "N", "F", "W", "payload B recv/peer/round", "payload B sent/peer/round",
                                 "most B sent one peer-round", "records recv/peer/round", "most records one peer", "rounds agreed",
                                 "utilization"], rows)
    costs = []
    for f in cfg.cost_sizes:
        console.print(f"apply costs at 1b sizes: {f} contributions")
        costs.append(apply_costs(f, seed=cfg.seed))
    if costs:
        print_table(console, "a round's apply at the 1b preset's sizes (CPU seconds, this machine)",
                    ["contributions", "decode s", "aggregate s", "copy check s", "total s"],
                    [[c["contributors"], c["decode_s"], c["aggregate_s"], c["copy_check_s"], c["total_s"]]
                     for c in costs])
    verdict = scale_verdict(runs, cfg)
    if verdict.get("line"):
        console.print(verdict["line"])
    doc = write_result(out, "scale", config, {"runs": runs, "costs": costs, "verdict": verdict, "complete": True})
    if out is not None and write_plot(Path(out).with_suffix(".png"), runs, title):
        console.print(f"plot: {Path(out).with_suffix('.png')}")
    return doc


def scale_verdict(runs: list[dict[str, Any]], cfg: ScaleBenchConfig) -> dict[str, Any]:
    """The growth of payload bytes received per peer from the smallest to the largest capped process run (the
    issue's bar: at most 1.25x), and whether every round agreed in every run."""
    capped = sorted((r for r in runs if r["mode"] == "processes" and r["gather"]), key=lambda r: r["n"])
    out: dict[str, Any] = {"all_rounds_agreed": all(r["rounds_agreed"] == r["rounds"] for r in runs)}
    if len(capped) >= 2 and capped[0]["recv_bytes_per_peer_round"] > 0:
        lo, hi = capped[0], capped[-1]
        out["recv_growth"] = hi["recv_bytes_per_peer_round"] / lo["recv_bytes_per_peer_round"]
        out["line"] = (f"payload bytes received per peer and round, N={lo['n']} -> N={hi['n']} at F={cfg.gather}: "
                       f"{out['recv_growth']:.2f}x (all-to-all grows about {(hi['n'] - 1) / (lo['n'] - 1):.1f}x)")
    return out
