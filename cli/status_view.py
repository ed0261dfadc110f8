"""The human view of ``hlbp status``: the report of :mod:`hlbp.peer.node.status` as a rich table."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def status_table(report: dict[str, Any]) -> Table:
    """The human view of :func:`status_report`: one row per peer, narrow enough for an 80-column terminal."""
    rounds = ("no round finished yet" if report.get("round") is None else
              f"round {report['round']}: {report['replicas_agreeing']} replicas agree")
    table = Table(title=f"run {report['run_id']}: {report['model']}, {len(report['stages'])} stages, "
                        f"{len(report['peers'])} peers, {report.get('outer', 'sparseloco')}; {rounds}",
                  box=None, pad_edge=False)
    for column in ("peer", "role", "where", "state", "round", "tok/s", "MB/s", "GB", "version", "reach", "seen"):
        table.add_column(column, justify="right" if column in ("tok/s", "MB/s", "GB", "seen") else "left")
    for p in report["peers"]:
        where = f"m{p['swarm']} s{p['stage']}" if p["role"] == "stage" else ""
        rnd = "" if p.get("round") is None else f"{p['round']}" + ("" if p["agrees"] else " (out)")
        table.add_row(
            p["peer_id"][-8:], p["role"], where, "online" if p["online"] else "offline", rnd,
            f"{p['throughput']:,.0f}",
            f"{p['bandwidth'] / 1e6:,.0f}", f"{p['memory_gb']:.0f}", f"{p['software']}/p{p['protocol']}",
            p["reachability"], f"{p['last_seen_s']:.0f}s",
        )
    return table
