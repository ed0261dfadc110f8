"""``hlbp bench memory``: the memory each role holds per parameter it trains, measured through real rounds.

For each model preset a loopback run (``hlbp simulate``'s launcher) of full replicas and one pipeline swarm trains a
few overlapped rounds; every peer's round records carry its process's peak resident set, the baseline it had just
before building its model (interpreter, torch, hivemind, the DHT: a few hundred MiB whatever the model), and the
parameters it trains (``hlbp.peer.common.memory``). The budget is ``(peak - baseline) / parameters``, per role:
a full replica trains every parameter, a stage peer its stage's (and keeps a copy of the shards it follows). Every
peer saves its checkpoint after every round, so the peak includes a save (a real run saves every 5 minutes).

What ``--recompute`` costs in time is measured apart, a step of each preset's whole model with and without it
alternating in one process (:mod:`hlbp.peer.bench.stepcost`): the rounds' compute seconds share two cores with five
other peers, too noisy for a ratio.

The projection for larger presets multiplies the largest measured preset's budget by their parameter counts (built
on the meta device: no memory) and adds the measured baseline, to say whether a full replica fits a host.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hlbp.peer.bench.report import print_table, write_result
from hlbp.peer.bench.stepcost import recompute_cost
from hlbp.peer.common import allocator
from hlbp.peer.common.errors import RunFailed
from hlbp.peer.sim.launcher import SimConfig
from hlbp.peer.sim.report import is_stage
from hlbp.peer.sim.run import run_simulation

GIB = 1 << 30
HOST_BUDGET_GIB = 24.0  # the volunteer host the projection is checked against (issue: a 1B replica on 24 GB)


@dataclass(frozen=True)
class MemoryBenchConfig:
    """What the memory benchmark runs: per preset, ``full`` replicas and one swarm of ``stages`` stage peers."""

    presets: tuple[str, ...] = ("small", "125m")
    projected: tuple[str, ...] = ("350m", "1b")
    full: int = 2
    stages: int = 4
    rounds: int = 3
    inner_steps: int = 5
    batch_size: int = 4
    seq_len: int = 64
    overlap: str = "eager"
    state_dtype: str | None = None  # every peer's --state-dtype (None: hlbp join's default, bf16)
    state_on_disk: bool | None = None  # every peer's --state-on-disk (None: hlbp join's default, on disk)
    recompute: bool = False  # every peer's --recompute (blocks run again in the backward, activations not held)
    step_samples: int = 4  # alternating steps timed with and without recompute, per preset and shape (stepcost)
    step_shapes: tuple[tuple[int, int], ...] = ((4, 64), (16, 128))  # batch x tokens of those steps
    seed: int = 0
    timeout_s: float = 1800.0
    workdir: Path | None = None

    @classmethod
    def quick(cls, **overrides: Any) -> MemoryBenchConfig:
        """CI-sized: the tiny model, 2 stages, 2 rounds (about a minute)."""
        return dataclasses.replace(cls(presets=("tiny",), stages=2, rounds=2, inner_steps=3, step_samples=3,
                                       step_shapes=((4, 64),)),
                                   **overrides)


def role_budget(memory: dict[str, dict[str, int]], stage: bool) -> dict[str, Any] | None:
    """The worst peer of a role in one run: its peak, baseline, parameters and bytes per parameter (None: the run
    had no peer of that role, or none reported its memory). ``memory``: peer -> its largest figures over rounds."""
    rows = [(name, m) for name, m in memory.items() if is_stage(name) == stage and m.get("trained_params")]
    if not rows:
        return None
    per = {name: (m["peak_host_bytes"] - m["base_host_bytes"]) / m["trained_params"] for name, m in rows}
    worst = max(per, key=lambda n: per[n])
    m = memory[worst]
    return {
        "peer": worst,
        "peak_host_bytes": m["peak_host_bytes"],
        "base_host_bytes": m["base_host_bytes"],
        "trained_params": m["trained_params"],
        "peak_host_bytes_per_param": per[worst],
        "peak_device_bytes": m.get("peak_device_bytes", 0),
        "peak_device_bytes_per_param": m.get("peak_device_bytes", 0) / m["trained_params"],
        "per_peer": {name: round(v, 2) for name, v in sorted(per.items())},
    }


def require_roles(preset: str, memory: dict[str, dict[str, int]], exit_codes: dict[str, int | None]) -> None:
    """Raise :class:`RunFailed` when a role has no measured peer in ``preset``'s run (its peers failed after starting):
    a table without that role would read as a measurement."""
    missing = [role for role, stage in (("full replica", False), ("stage peer", True))
               if role_budget(memory, stage) is None]
    if missing:
        failed = {n: c for n, c in exit_codes.items() if c}
        raise RunFailed(f"the {preset} run measured no {' and no '.join(missing)} "
                        f"({'exit codes: ' + str(failed) if failed else 'no round recorded'}); "
                        "keep the peers' logs with --workdir to see why")


def peak_memory(rounds: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per peer, the largest of each memory figure over the rounds of a simulate report."""
    out: dict[str, dict[str, int]] = {}
    for r in rounds:
        for name, m in r.get("memory", {}).items():
            mine = out.setdefault(name, {})
            for k, v in m.items():
                mine[k] = max(mine.get(k, 0), int(v or 0))
    return out


def preset_run(cfg: MemoryBenchConfig, preset: str, workdir: Path) -> dict[str, Any]:
    """One loopback run of ``preset``; the budget of each role and whether every round agreed."""
    sim = SimConfig(n_full=cfg.full, n_swarms=1, n_stages=cfg.stages, model=preset, rounds=cfg.rounds,
                    inner_steps=cfg.inner_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, overlap=cfg.overlap,
                    seed=cfg.seed, threads=1, run_id=f"memory-{preset}", startup_timeout_s=600.0,
                    max_deadline_s=120.0, round_deadline_s=30.0, checkpoint_every_s=0.0, state_dtype=cfg.state_dtype,
                    state_on_disk=cfg.state_on_disk, recompute=cfg.recompute)
    report = run_simulation(sim, workdir, cfg.timeout_s)
    memory = peak_memory(report["rounds"])
    require_roles(preset, memory, report.get("exit_codes", {}))
    roles = report.get("by_role", {})
    return {
        "preset": preset,
        "full_replica": role_budget(memory, stage=False),
        "stage_peer": role_budget(memory, stage=True),
        # what the settings cost in time: the role's training seconds over every round record of the run (a run with
        # --recompute against one without, same settings otherwise)
        "compute_s": {role: roles[key]["compute_s"] for role, key in (("full_replica", "full"), ("stage_peer", "stage"))
                      if key in roles},
        "rounds": len(report["rounds"]),
        "rounds_agreed": sum(1 for r in report["rounds"] if r["checksums_equal"] and r["in_sync"]),
        "n_params": report.get("n_params"),
    }


def count_params(preset: str) -> int:
    """A preset's parameters (its model built on the meta device)."""
    import torch

    from hlbp.peer.model.decoder import build_model, count_parameters
    from hlbp.peer.model.decoder import preset as make_preset

    with torch.device("meta"):
        return count_parameters(build_model(make_preset(preset)))


def project(runs: list[dict[str, Any]], presets: tuple[str, ...]) -> list[dict[str, Any]]:
    """Full-replica host memory for ``presets`` from the largest measured preset's bytes per parameter and
    baseline, and whether it fits :data:`HOST_BUDGET_GIB`."""
    measured = [r for r in runs if r.get("full_replica")]
    if not measured:
        return []
    ref = max(measured, key=lambda r: r["full_replica"]["trained_params"])["full_replica"]
    out = []
    for name in presets:
        n = count_params(name)
        host = ref["base_host_bytes"] + ref["peak_host_bytes_per_param"] * n
        out.append({"preset": name, "params": n, "from": ref["peer"], "bytes_per_param": ref["peak_host_bytes_per_param"],
                    "host_gib": host / GIB, "fits_host": host <= HOST_BUDGET_GIB * GIB})
    return out


def marginal(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per role, the bytes each further parameter costs between two measured presets: the growth of the worst
    peer's peak above its baseline over the growth of its trained parameters, from each preset to the next larger
    one. It needs no baseline to be right: whatever a process holds whatever its model's size (the runtime's
    kernels and libraries, the data, the network stack) cancels out."""
    out = []
    for role in ("full_replica", "stage_peer"):
        rows = sorted((r for r in runs if r.get(role)), key=lambda r: r[role]["trained_params"])
        for a, b in itertools.pairwise(rows):
            ra, rb = a[role], b[role]
            extra = rb["trained_params"] - ra["trained_params"]
            if extra <= 0:
                continue
            host = (rb["peak_host_bytes"] - rb["base_host_bytes"]) - (ra["peak_host_bytes"] - ra["base_host_bytes"])
            out.append({"role": role, "from": a["preset"], "to": b["preset"], "params": extra,
                        "host_bytes_per_param": host / extra,
                        "device_bytes_per_param": (rb["peak_device_bytes"] - ra["peak_device_bytes"]) / extra})
    return out


def run_memory_bench(cfg: MemoryBenchConfig, out: Path | None = None,
                     console: Console | None = None) -> dict[str, Any]:
    """Every preset's run, the table, the projection and the JSON (written after each run)."""
    console = console or Console(stderr=True)
    # the peers run the allocator this process runs (hlbp.peer.common.allocator): it moves the figures by 2-4 B/param
    config = {**dataclasses.asdict(cfg), "allocator": allocator.in_use()}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hlbp-memory-") as tmp:
        base = cfg.workdir or Path(tmp)
        for name in cfg.presets:
            console.print(f"memory: {name}, {cfg.full} full replicas and one swarm of {cfg.stages} stages")
            workdir = base / name
            workdir.mkdir(parents=True, exist_ok=True)
            runs.append(preset_run(cfg, name, workdir))
            write_result(out, "memory", config, {"runs": runs, "complete": False})
    rows = []
    for r in runs:
        for role in ("full_replica", "stage_peer"):
            b = r.get(role)
            if b is None:
                continue
            rows.append([r["preset"], role.replace("_", " "), b["trained_params"], b["base_host_bytes"] / GIB,
                         b["peak_host_bytes"] / GIB, b["peak_host_bytes_per_param"],
                         b["peak_device_bytes_per_param"] if b["peak_device_bytes"] else "-",
                         r.get("compute_s", {}).get(role, "-"), f"{r['rounds_agreed']}/{r['rounds']}"])
    print_table(console, f"memory: peak above the pre-model baseline, {cfg.rounds} rounds of H={cfg.inner_steps}, "
                         f"overlap {cfg.overlap}, batch {cfg.batch_size}x{cfg.seq_len}, "
                         f"own state {cfg.state_dtype or 'bf16'}, malloc {config['allocator']}"
                         f"{' in memory' if cfg.state_on_disk is False else ''}"
                         f"{', blocks recomputed' if cfg.recompute else ''}",
                ["preset", "role", "params trained", "baseline GiB", "peak GiB", "host B/param", "device B/param",
                 "compute s", "rounds agreed"], rows)
    slopes = marginal(runs)
    if slopes:
        print_table(console, "bytes each further parameter costs, between two presets (no baseline involved)",
                    ["role", "from", "to", "host B/param", "device B/param"],
                    [[m["role"].replace("_", " "), m["from"], m["to"], m["host_bytes_per_param"],
                      m["device_bytes_per_param"] if m["device_bytes_per_param"] else "-"] for m in slopes])
    costs = [recompute_cost(name, b, t, cfg.step_samples, cfg.seed) for name in cfg.presets for b, t in cfg.step_shapes]
    print_table(console, f"--recompute in one training step of the whole model: bytes per parameter held for the "
                         f"backward, and the median of {cfg.step_samples} alternating steps, in one process",
                ["preset", "batch", "held B/param", "recomputed B/param", "held s", "recomputed s", "time ratio"],
                [[c["preset"], "x".join(map(str, c["batch"])), c["held_bytes_per_param"],
                  c["recomputed_bytes_per_param"], c["held_s"], c["recomputed_s"], c["ratio"]] for c in costs])
    projection = project(runs, cfg.projected)
    if projection:
        print_table(console, f"full replica projected from the largest measured preset (host budget {HOST_BUDGET_GIB:g} GiB)",
                    ["preset", "params", "B/param", "host GiB", "fits"],
                    [[p["preset"], p["params"], p["bytes_per_param"], p["host_gib"], "yes" if p["fits_host"] else "no"]
                     for p in projection])
    return write_result(out, "memory", config, {"runs": runs, "marginal": slopes, "projection": projection,
                                                      "recompute_step": costs, "complete": True})
