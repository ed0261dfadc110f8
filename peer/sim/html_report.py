"""A run's report as one self-contained HTML page (``hlbp report``; ``hlbp simulate`` writes one at the end).

It reads what a run wrote: ``hlbp simulate``'s report (its ``--out`` JSON, or ``report.json`` in its work
directory) or a joined replica's output directory (its ``metrics.jsonl``), and draws, round by round: validation loss
against tokens per role, bytes sent and received per peer, utilization and waiting, and how many contributions each
shard accepted, then the table of rounds. The plots are PNGs inlined as data URLs, so the page is one file that opens
anywhere; without matplotlib (the ``plots`` extra) the page holds the table only and says so.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hlbp.peer.common.errors import UserInputError

REPORT_JSON = "report.json"  # what hlbp simulate writes into its work directory
REPORT_HTML = "report.html"
MAX_INPUT_BYTES = 256 * 1024 * 1024


def load_run(path: Path) -> dict[str, Any]:
    """A run's rounds in one shape: ``{"title", "config", "rounds": [...]}``, each round with ``round``,
    ``val_loss`` per role, ``bytes_sent``/``bytes_received`` per peer, ``compute_s``/``comm_s``/``wait_s``,
    ``utilization``, ``members`` and accepted contributions per shard. ``path``: simulate's JSON report, a
    directory holding ``report.json``, or a replica's output directory holding ``metrics.jsonl``."""
    path = Path(path)
    if path.is_dir() and (path / REPORT_JSON).is_file():
        path = path / REPORT_JSON
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        return _from_metrics(path / "metrics.jsonl")
    if not path.is_file():
        raise UserInputError(f"{path}: give hlbp simulate's report JSON, its work directory, or a replica's output "
                             "directory (with metrics.jsonl)")
    if path.stat().st_size > MAX_INPUT_BYTES:
        raise UserInputError(f"{path} is over {MAX_INPUT_BYTES >> 20} MiB: not a run report")
    if path.name.endswith(".jsonl"):
        return _from_metrics(path)
    try:
        report = json.loads(path.read_text())
        rounds = [_sim_round(r) for r in report["rounds"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{path} is not a report hlbp simulate wrote ({exc})") from None
    config = report.get("config") if isinstance(report.get("config"), dict) else {}
    return {"title": f"hlbp simulate: {config.get('run_id', path.stem)}", "config": config, "rounds": rounds}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _sim_round(r: Mapping[str, Any]) -> dict[str, Any]:
    loss = {"full replicas": _num(r.get("full_val_loss"))}
    loss.update({f"swarm {name}": _num(v) for name, v in (r.get("swarm_val_loss") or {}).items()})
    shards: dict[str, int] = {}
    for peer in r.get("accepted") or []:
        for s in (r.get("shards") or {}).get(peer, []):
            shards[str(s)] = shards.get(str(s), 0) + 1
    return {"round": int(r["round"]), "val_loss": {k: v for k, v in loss.items() if v is not None},
            "bytes_sent": {str(k): _num(v) or 0.0 for k, v in (r.get("bytes_sent") or {}).items()},
            "bytes_received": {str(k): _num(v) or 0.0 for k, v in (r.get("bytes_received") or {}).items()},
            "compute_s": _num(r.get("compute_s")), "comm_s": _num(r.get("comm_s")), "wait_s": _num(r.get("wait_s")),
            "utilization": _num(r.get("utilization")), "members": r.get("members"), "accepted_per_shard": shards,
            "agreed": r.get("checksums_equal")}


def _from_metrics(path: Path) -> dict[str, Any]:
    """One replica's rounds from its ``metrics.jsonl`` (lines that are not round records are skipped)."""
    if path.stat().st_size > MAX_INPUT_BYTES:
        raise UserInputError(f"{path} is over {MAX_INPUT_BYTES >> 20} MiB: not a metrics log")
    rounds = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") != "round" or not isinstance(rec.get("round"), int):
            continue
        compute, comm, wait = (_num(rec.get(k)) or 0.0 for k in ("compute_s", "comm_s", "wait_s"))
        busy = compute + comm + wait
        rounds.append({"round": rec["round"], "val_loss": {"this replica": v} if (v := _num(rec.get("val_loss")))
                       is not None else {},
                       "bytes_sent": {"this replica": _num(rec.get("bytes_sent")) or 0.0},
                       "bytes_received": {"this replica": _num(rec.get("bytes_received")) or 0.0},
                       "compute_s": compute, "comm_s": comm, "wait_s": wait,
                       "utilization": compute / busy if busy else None, "members": rec.get("members"),
                       "accepted_per_shard": {}, "agreed": rec.get("in_sync")})
    if not rounds:
        raise UserInputError(f"{path} holds no round records yet")
    return {"title": f"hlbp replica: {path.parent.name}", "config": {}, "rounds": rounds}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _drawn(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, caption: str) -> tuple[str, str]:
    """Label ``ax``, add its legend and grid, and return (caption, PNG data URL) of ``fig``, closed."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    try:
        return caption, _png(fig)
    finally:
        plt.close(fig)


def _per_peer(values: Mapping[str, float]) -> float:
    """The mean over peers of a round's per-peer numbers (0 with none)."""
    return sum(values.values()) / max(1, len(values))


def _plots(run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(caption, PNG data URL) of each plot; empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rounds: Sequence[Mapping[str, Any]] = run["rounds"]
    xs = [r["round"] for r in rounds]
    cfg = run["config"]
    per_round = (cfg.get("inner_steps") or 0) * (cfg.get("batch_size") or 0) * (cfg.get("seq_len") or 0)
    out = []
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    # every role scores the same global model after a round, so their lines coincide: dashes keep each visible
    for i, role in enumerate(sorted({k for r in rounds for k in r["val_loss"]})):
        pts = [((r["round"] + 1) * per_round if per_round else r["round"], r["val_loss"][role])
               for r in rounds if role in r["val_loss"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=role,
                linestyle=("-", "--", ":", "-.")[i % 4])
    out.append(_drawn(plt, fig, ax, "tokens per replica" if per_round else "round", "validation loss",
                      "Validation loss against tokens, per role"))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, label in (("bytes_sent", "sent"), ("bytes_received", "received")):
        ax.plot(xs, [_per_peer(r[key]) for r in rounds], marker="o", ms=3, label=label)
    out.append(_drawn(plt, fig, ax, "round", "bytes per peer", "Bytes sent and received per peer and round"))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(xs, [100 * (r["utilization"] or 0) for r in rounds], marker="o", ms=3, label="utilization %")
    ax2 = ax.twinx()
    ax2.bar(xs, [r["wait_s"] or 0 for r in rounds], alpha=0.3, color="tab:red", label="wait s")
    ax.set_xlabel("round")
    ax.set_ylabel("utilization (%)")
    ax2.set_ylabel("waiting for the round (s)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    out.append(("Utilization (compute / (compute + comm + wait)) and waiting, per round", _png(fig)))
    plt.close(fig)

    shards = sorted({s for r in rounds for s in r["accepted_per_shard"]}, key=lambda s: (len(s), s))
    if shards:
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        width = 0.8 / len(shards)
        for i, s in enumerate(shards):
            ax.bar([x + i * width for x in xs], [r["accepted_per_shard"].get(s, 0) for r in rounds], width,
                   label=f"shard {s}")
        ax.set_xlabel("round")
        ax.set_ylabel("contributions accepted")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(shards))
        out.append(("Accepted contributions per round and shard", _png(fig)))
        plt.close(fig)
    return out


def _table(rounds: Sequence[Mapping[str, Any]]) -> str:
    head = ("round", "val loss", "members", "sent B/peer", "recv B/peer", "compute s", "comm s", "wait s",
            "utilization", "checksums equal")
    rows = []
    for r in rounds:
        loss = ", ".join(f"{k} {v:.4f}" for k, v in r["val_loss"].items())
        cells = (r["round"], loss, r["members"], f"{_per_peer(r['bytes_sent']):,.0f}",
                 f"{_per_peer(r['bytes_received']):,.0f}",
                 *(f"{r[k]:.2f}" if r[k] is not None else "" for k in ("compute_s", "comm_s", "wait_s")),
                 f"{r['utilization']:.1%}" if r["utilization"] is not None else "", r["agreed"])
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


def render(run: Mapping[str, Any]) -> str:
    """The HTML page of a run (:func:`load_run`)."""
    plots = _plots(run)
    figures = "".join(f'<figure><img src="{src}" alt="{html.escape(cap)}"><figcaption>{html.escape(cap)}'
                      "</figcaption></figure>" for cap, src in plots) or \
        "<p>No plots: matplotlib is not installed (<code>pip install 'hlbp[plots]'</code>).</p>"
    cfg = run["config"]
    settings = ", ".join(f"{k} {cfg[k]}" for k in ("model", "n_full", "n_swarms", "n_stages", "inner_steps",
                                                    "batch_size", "seq_len", "outer") if k in cfg)
    title = html.escape(run["title"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
            "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
            "figure{display:inline-block;margin:0.5em}img{max-width:520px}"
            "table{border-collapse:collapse;font-size:0.85em}td,th{border:1px solid #ccc;padding:3px 6px}"
            f"</style></head><body><h1>{title}</h1><p>{html.escape(settings)}; {len(run['rounds'])} rounds</p>"
            f"{figures}<h2>Rounds</h2>{_table(run['rounds'])}</body></html>")


def write_report(source: Path, out: Path | None = None) -> Path:
    """Render ``source`` (see :func:`load_run`) to ``out`` (default: ``report.html`` beside it); returns ``out``."""
    run = load_run(source)
    source = Path(source)
    out = Path(out) if out is not None else (source if source.is_dir() else source.parent) / REPORT_HTML
    out.write_text(render(run), encoding="utf-8")
    return out
