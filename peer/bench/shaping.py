"""Shaped link (``shaped_mbps``, ``hlbp bench network --shape-mbps R``, root only): on unshaped loopback bytes are
nearly free, so the benchmark can instead run inside a fresh network namespace whose own ``lo`` is rate-limited to
R Mbit/s with a ``tc`` token bucket (tbf). Every process of the run (the p2pd daemons too) lives in that namespace,
so nothing else on the machine is shaped, and the loopback byte counter counts only the benchmark's traffic. All N
peers share the one shaped link, as peers behind a single uplink would: every byte any peer sends crosses it once,
so the floor is N times the bytes one peer receives, over R. Latency is not emulated (this kernel has no netem):
round trips stay loopback-fast, so a protocol with many round trips (the DHT records of a SparseLoCo round) looks
better than it would over a real WAN. The corpus is prepared before entering the namespace (it has no internet).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from hlbp.peer.bench.network import NetworkBenchConfig
from hlbp.peer.common.errors import UserInputError

LO_MTU = 65536  # the loopback MTU; GSO hands tbf packets up to this size
TBF_LATENCY_MS = 100  # longest a packet may queue in the bucket before tbf drops it (sets the queue length)
NETNS_PREFIX = "hlbp-bench-"


def tbf_burst_bytes(rate_mbps: float, mtu: int = LO_MTU) -> int:
    """Bucket size for tbf: 10 ms of traffic at the rate, and never less than two full loopback packets.

    tbf cannot pass a packet larger than its bucket, and on loopback packets are up to 64 KiB, so a burst sized for
    the rate alone (12.5 KB per ms at 100 Mbit/s) would stall TCP at low rates. 10 ms at the rate keeps the
    bucket negligible next to transfers of seconds.
    """
    return max(2 * (mtu + 14), int(rate_mbps * 1e6 / 8 * 0.010))


def netns_name(pid: int) -> str:
    """The namespace of one shaped run, named after the process that owns it (so it is found and cleaned up)."""
    return f"{NETNS_PREFIX}{pid}"


def shape_commands(ns: str, rate_mbps: float, mtu: int = LO_MTU) -> list[list[str]]:
    """The ``ip``/``tc`` command lines that create namespace ``ns`` with its ``lo`` up and limited to the rate."""
    tbf = ["tbf", "rate", f"{round(rate_mbps * 1000)}kbit", "burst", str(tbf_burst_bytes(rate_mbps, mtu)),
           "latency", f"{TBF_LATENCY_MS}ms"]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", *tbf],
    ]


def shaped_bench_argv(cfg: NetworkBenchConfig, ns: str, out: Path | None, threads: int | None,
                      python: str = sys.executable) -> list[str]:
    """The command line that runs this benchmark, with the same settings, inside namespace ``ns``."""
    if cfg.shaped_mbps is None:
        raise ValueError("shaped_bench_argv needs cfg.shaped_mbps")
    argv = [python, "-m", "hlbp.cli.main", "bench", "network",
            "--models", ",".join(cfg.models), "--peers", ",".join(str(n) for n in cfg.peers),
            "--rounds", str(cfg.rounds), "--k", str(cfg.k), "--link-probe-mib", str(cfg.link_probe_mib),
            "--matchmaking-s", repr(cfg.matchmaking_s), "--step-timeout-s", repr(cfg.step_timeout_s),
            "--seed", str(cfg.seed), "--shape-mbps", repr(cfg.shaped_mbps), "--inside-netns", ns]
    if threads:
        argv += ["--threads", str(threads)]
    if out is not None:
        argv += ["--out", str(Path(out).resolve())]
    return ["ip", "netns", "exec", ns, *argv]


def shaping_problem(euid: int, tools: dict[str, str | None]) -> str | None:
    """Why a shaped run cannot start here (one line saying what to do), or None. ``tools``: name -> path or None."""
    if euid != 0:
        return "--shape-mbps needs root (network namespaces and tc); run it as root or leave --shape-mbps out"
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        return f"--shape-mbps needs {' and '.join(missing)} (package iproute2); install it or leave --shape-mbps out"
    return None


def current_netns() -> str | None:
    """The name of the network namespace this process runs in (``ip netns identify``), or None."""
    try:
        done = subprocess.run(["ip", "netns", "identify", str(os.getpid())], check=False, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _sh(cmd: list[str]) -> None:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        hint = "the kernel needs the tbf qdisc (sch_tbf)" if "tc" in cmd else "network namespaces must work here"
        raise UserInputError(f"`{' '.join(cmd)}` failed: {why}; {hint}, or leave --shape-mbps out")


def _remove_netns(ns: str) -> None:
    """End what is left of the run in ``ns`` (its processes, by pid: only ours live there), then delete it."""
    left = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True, timeout=30)
    for pid in left.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


def run_shaped(cfg: NetworkBenchConfig, out: Path | None, console: Console, threads: int | None = None) -> int:
    """Run the benchmark in a fresh namespace whose ``lo`` is limited to ``cfg.shaped_mbps``; its exit status.

    The namespace is deleted afterwards, also after an error or Ctrl-C. Raises UserInputError when shaping is
    impossible here (not root, no ``ip``/``tc``, no tbf).
    """
    from hlbp.peer.data.streams import prepare_data

    cfg.check()
    if cfg.shaped_mbps is None:
        raise ValueError("run_shaped needs cfg.shaped_mbps")
    problem = shaping_problem(os.geteuid(), {t: shutil.which(t) for t in ("ip", "tc")})
    if problem:
        raise UserInputError(problem)
    prepare_data("builtin", cache_dir=cfg.cache_dir)  # inside the namespace there is no internet
    ns = netns_name(os.getpid())
    commands = shape_commands(ns, cfg.shaped_mbps)
    _sh(commands[0])
    proc = None
    try:
        for cmd in commands[1:]:
            _sh(cmd)
        console.print(f"network namespace {ns}: lo limited to {cfg.shaped_mbps:g} Mbit/s "
                      f"(tbf burst {tbf_burst_bytes(cfg.shaped_mbps)} B, latency {TBF_LATENCY_MS} ms)")
        env = dict(os.environ)
        if cfg.cache_dir is not None:
            env["HLBP_CACHE"] = str(Path(cfg.cache_dir).expanduser().resolve())
        proc = subprocess.Popen(shaped_bench_argv(cfg, ns, out, threads), env=env)
        return proc.wait()
    finally:
        if proc is not None and proc.poll() is None:
            _stop_child(proc)
        _remove_netns(ns)


def _stop_child(proc: subprocess.Popen) -> None:
    """Stop the benchmark child after Ctrl-C or an error here. It ignores SIGINT (hivemind's averager sets SIG_IGN
    in the process that starts it), so it gets SIGTERM, then SIGKILL; its daemons are ended by _remove_netns."""
    for sig, grace in ((None, 2.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue
