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
from rich.console import Console
from rich.live import Live
from rich.table import Table

from hlbp.cli.options import flags_command, make_console
from hlbp.cli.sim_flags import SimFlags

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
        if "paired" in last:  # a NoLoCo round: whether its partner's message came in time
            ours = "paired" if last["paired"] else "alone"
        else:
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
    pairs = report.get("config", {}).get("outer") == "noloco"
    agree_col = "paired" if pairs else "states agree" if dense else "checksums equal"
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
            (f"{r.get('paired', 0)}/{r['peers']}" if pairs else "yes" if r["checksums_equal"]
             else "to fp rounding" if r["states_agree"] else "[red]NO[/]"), f"{sum(sent) / len(sent):,.0f}",
            f"{sum(recv) / len(recv):,.0f}", f"{r['compute_s']:.2f}", f"{r['comm_s']:.2f}", f"{r['wait_s']:.2f}",
            f"{util:.1%}" if util is not None else "-",
        )
    return table


@flags_command(SimFlags)
def simulate(flags: SimFlags) -> None:
    """Start a bootstrap, N full replicas and M pipeline swarms on 127.0.0.1, run R outer rounds, and report.

    Full replicas contribute every shard, stage peers their own stage's shard, to the same SparseLoCo rounds;
    only the swarms' stage boundaries compress activations (--codec).

    The report shows the validation loss per round, whether every peer ended each round with the same parameter
    checksums, the bytes each peer sent and received, the round time split into compute, communication and
    waiting, and the dense fp32 bytes the same exchange would have needed. Every process is stopped at the end,
    also on Ctrl-C.
    """
    from hlbp.peer.sim.html_report import REPORT_JSON, write_report
    from hlbp.peer.sim.run import run_simulation

    work = flags.workdir or Path(tempfile.mkdtemp(prefix="hlbp-simulate-"))
    rounds = flags.rounds
    who = f"{flags.full} full replicas" + (
        f" and {flags.swarms} pipeline swarms of {flags.stages} stage peers" if flags.swarms else "")
    console.print(f"simulating {who} x {rounds} {flags.outer} rounds of {flags.model} on 127.0.0.1 (overlap "
                  f"{flags.overlap_mode}); logs in {work}")
    with Live(progress_table({}, rounds), console=console, refresh_per_second=2) as live:
        report = run_simulation(flags.config(), work, flags.timeout,
                                on_progress=lambda recs: live.update(progress_table(recs, rounds)))
    out_console = make_console(stderr=False)
    print_report(out_console, report, rounds)
    if flags.out is not None:
        flags.out.parent.mkdir(parents=True, exist_ok=True)
        flags.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
        out_console.print(f"report written to {flags.out}")
    (work / REPORT_JSON).write_text(json.dumps(report, indent=1), encoding="utf-8")
    if report["rounds"]:
        out_console.print(f"report with plots: {write_report(work / REPORT_JSON)} (hlbp report redraws it)")
    # a NoLoCo run's replicas never agree bit for bit: its failure is an unfinished run, not differing states
    if report["rounds_completed"] < rounds or ("noloco" not in report and not all(report["states_agree"])):
        raise typer.Exit(1)


def print_report(out_console: Console, report: dict[str, Any], rounds: int) -> None:
    """The summary table, then one line each on completion, time split, validation loss and bytes on the wire."""
    dense = report.get("config", {}).get("outer") == "diloco"
    pairs = report.get("noloco")
    out_console.print(summary_table(report))
    t = report["time_s"]
    util = report["utilization"]
    out_console.print(f"rounds completed: {report['rounds_completed']}/{rounds}"
                      + ("  [red](timed out)[/]" if report["timed_out"] else "")
                      + ("" if pairs else f"; checksums equal after every round: {all(report['checksums_equal'])}")
                      + (f"; states agree to float rounding: {all(report['states_agree'])}" if dense else ""))
    if pairs:
        spread = f"{pairs['spread']:.3g}" if pairs["spread"] is not None else "-"
        out_console.print(f"noloco: {pairs['paired']:.0%} of the replicas' rounds paired, {pairs['bounded']} partner "
                          f"tensors bounded, spread of the replicas' outer weights {spread} (final checkpoints; "
                          "replicas never agree bit for bit, so there are no checksums to compare)")
    out_console.print(f"time per round and peer: compute {t['compute'] / max(1, len(report['rounds'])):.2f} s, "
                      f"comm {t['comm'] / max(1, len(report['rounds'])):.2f} s, "
                      f"wait {t['wait'] / max(1, len(report['rounds'])):.2f} s, "
                      f"steps waiting for their turn {t.get('turn_wait', 0.0) / max(1, len(report['rounds'])):.2f} s; "
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
        out_console.print("validation loss: " + "; ".join(parts))
    roles = report.get("by_role", {})
    if len(roles) > 1:  # over every round; busy: the share of the round loop's wall time spent training
        out_console.print("by role over the run: " + ", ".join(
            f"{k} utilization {v['utilization']:.0%} (busy {v['busy']:.0%} of wall time)"
            for k, v in roles.items() if v["utilization"] is not None and v["busy"] is not None))
    bpr = report["bytes_per_peer_round"]
    if report.get("n_params"):
        ratio = report["compression_ratio"]
        out_console.print(f"bytes per peer and round: sent {bpr['sent']:,.0f}, received {bpr['received']:,.0f}; "
                          f"dense fp32 equivalent {report['dense_fp32_bytes_per_peer_round']:,} "
                          f"({report['n_params']:,} params x 4 B) = "
                          + ("n/a" if not ratio else f"{ratio:,.2f}x the all-reduce's bytes (analytic: "
                             "2(N-1)/N x 4 B x params per member)" if dense else
                             f"{ratio:,.0f}x the measured {'NoLoCo' if pairs else 'SparseLoCo'} bytes"))
        if not dense and report.get("allreduce_ratio"):
            out_console.print(f"a dense fp32 all-reduce among {report['dense_allreduce_members']} replicas "
                              f"(hlbp simulate --outer diloco) moves {report['dense_allreduce_bytes_per_peer_round']:,}"
                              f" B per peer each way: {report['allreduce_ratio']:,.0f}x the "
                              f"{'NoLoCo' if pairs else 'SparseLoCo'} traffic")
    rpr = report.get("records_per_peer_round")
    if rpr:
        out_console.print(f"round records per peer and round: received {rpr['received']:,.1f} (pushed to it or "
                          f"returned by its DHT reads), pushed {rpr['sent']:,.1f}")
    audits = report.get("audits") or {}
    if audits.get("audits"):
        share = audits.get("compute_share")
        wall = audits.get("wall_share")
        found = ", ".join(f"{n} {k}" for k, n in sorted(audits["findings"].items()))
        out_console.print(f"pipeline audits: {audits['audits']} stage peers audited, {audits['guilty']} convicted "
                          f"(samples: {found or 'none'}; marked by the screen: {audits.get('flagged', 0)}); "
                          f"recomputing took "
                          f"{'n/a' if share is None else f'{100 * share:.2f} %'} of the stage peers' compute, "
                          f"{'n/a' if wall is None else f'{100 * wall:.1f} %'} with fetching the frames")


def register(app: typer.Typer) -> None:
    """Add ``simulate`` to the ``hlbp`` app."""
    app.command()(simulate)
