"""``hlbp simulate``'s whole run: start a loopback swarm (:mod:`hlbp.peer.sim.launcher`), wait for its rounds, stop
it, and build the report from what the peers wrote (their round records, the full replicas' audits, the stage peers'
summaries). The processes are the launcher's; this module is the run and its report.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlbp.peer.sim.launcher import SimConfig, Swarm
from hlbp.peer.sim.report import audit_summary, count_params, is_stage, stage_name, summarize
from hlbp.peer.train.metricslog import read_metrics


def _audits(paths: dict[str, Path | None]) -> tuple[list[dict[str, Any]], float]:
    """The full replicas' audit events and the stage peers' compute seconds (their summaries), for the report."""
    audits, busy = [], 0.0
    for name, path in paths.items():
        if path is None or not path.exists():
            continue
        if not is_stage(name):
            audits += [r for r in read_metrics(path) if r.get("event") == "audit"]
            continue
        summary = path.parent / "summary.json"
        if summary.exists():
            own = json.loads(summary.read_text()).get("busy_s", 0.0)
            busy += float(own.get("driver", 0.0) if isinstance(own, dict) else own)
    return audits, busy


def noloco_summary(records: dict[str, list[dict[str, Any]]], paths: dict[str, Path | None]) -> dict[str, Any]:
    """A NoLoCo run's own numbers: how often a replica's round was paired, how often a partner's message had to
    be bounded, and the spread of the replicas' outer weights in their final checkpoints."""
    from hlbp.peer.rounds.noloco import spread
    from hlbp.peer.train.checkpoint import load_checkpoint

    rows = [r for recs in records.values() for r in recs]
    phis = []
    for path in paths.values():
        ckpt = None if path is None else path.parent / "checkpoint.safetensors"
        if ckpt is not None and ckpt.exists():
            tensors, _ = load_checkpoint(ckpt)
            phis.append({n[4:]: t for n, t in tensors.items() if n.startswith("phi.")})
    return {"paired": sum(1 for r in rows if r.get("paired")) / len(rows) if rows else 0.0,
            "bounded": sum(int(r.get("bounded", 0)) for r in rows),
            "spread": spread(phis) if len(phis) > 1 else None, "checkpoints": len(phis)}


def run_simulation(cfg: SimConfig, workdir: Path, timeout_s: float,
                   on_progress: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None) -> dict[str, Any]:
    """Start a bootstrap and ``cfg.n_full`` replicas, wait until each has run ``cfg.rounds`` rounds or left (or
    ``timeout_s`` passes), stop everything, and return :func:`summarize`'s report plus where the logs are."""
    started = time.monotonic()
    with Swarm(cfg, workdir) as swarm:
        swarm.start()
        contributors = cfg.n_full + cfg.n_swarms * cfg.n_stages
        # servers first, so each driver finds its chain; each names its swarm (--swarm), as the report's peer
        # names do
        for m in range(cfg.n_swarms):
            for stage in range(1, cfg.n_stages):
                swarm.add_stage(stage_name(m, stage), stage, swarm=m).proc.wait_for("^announced",
                                                                                   cfg.startup_timeout_s)
        for i in range(cfg.n_full):  # they start round 0 together, not each as it finishes joining
            swarm.add(f"peer{i}", "--wait-replicas", str(contributors))
        for m in range(cfg.n_swarms):
            swarm.add_stage(stage_name(m, 0), 0, "--micro-batches", str(cfg.micro_batches), "--eval-every", "0",
                            swarm=m).proc.wait_for("^announced", cfg.startup_timeout_s)
        deadline = started + timeout_s
        timed_out = False
        while True:
            records = {n: recs[:cfg.rounds] for n, recs in swarm.records().items()}
            if on_progress is not None:
                on_progress(records)
            finished = [len(recs) >= cfg.rounds or not swarm.replicas[n].proc.alive for n, recs in records.items()]
            if all(finished):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)  # the polling interval of the progress display, bounded by the deadline above
        for name, replica in swarm.replicas.items():  # stage peers serve until stopped: stop them now
            if name.startswith("sw") and replica.proc.alive:
                replica.proc.popen.send_signal(signal.SIGTERM)
        for replica in swarm.replicas.values():  # let finished peers save and leave on their own
            try:
                replica.proc.popen.wait(timeout=max(0.1, min(cfg.stop_timeout_s, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        exits = {n: r.proc.popen.poll() for n, r in swarm.replicas.items()}
        wan = None
        if swarm.wan is not None:
            carried = swarm.wan.stats().values()
            wan = {"delay_ms": cfg.wan_delay_ms, "mbps": cfg.wan_mbps,
                   "proxied_bytes": sum(p.inbound + p.outbound for p in carried),
                   "connections": sum(p.connections for p in carried)}
        paths = {n: r.metrics_path() for n, r in swarm.replicas.items()}
    records = {n: recs[:cfg.rounds] for n, recs in swarm.records().items()}
    n_params = None
    for path in paths.values():
        if path is not None and (path.parent / "checkpoint.safetensors").exists():
            n_params = count_params(path.parent / "checkpoint.safetensors",
                                    "phi." if cfg.outer == "noloco" else "anchor.")
            break
    report = summarize(records, n_params, cfg.rounds)
    if cfg.outer == "noloco":
        report["noloco"] = noloco_summary(records, paths)
    report["audits"] = audit_summary(*_audits(paths))
    report.update(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
                  seconds=round(time.monotonic() - started, 1), timed_out=timed_out, exit_codes=exits, wan=wan,
                  workdir=str(workdir))
    return report
