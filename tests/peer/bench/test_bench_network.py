"""`hlbp bench network` in process, cut down: real p2pd peers, both methods measured, and the bytes add up; the
command lines of a shaped run (namespace, tc tbf, the re-run inside), and one shaped run where root and tc allow."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from hlbp.cli.bench import bench_app
from hlbp.peer.bench.network import NetworkBenchConfig, dense_allreduce_bytes, run_network_bench, summarise
from hlbp.peer.bench.shaping import (
    LO_MTU,
    netns_name,
    run_shaped,
    shape_commands,
    shaped_bench_argv,
    shaping_problem,
    tbf_burst_bytes,
)
from hlbp.peer.common.errors import UserInputError


@pytest.mark.slow
def test_quick_network_bench_measures_both_methods(tmp_path: Path, cache_dir: Path) -> None:
    # A small probe blob keeps the link measurement itself under a second.
    cfg = NetworkBenchConfig.quick(rounds=1, link_probe_mib=4, matchmaking_s=1.0, cache_dir=cache_dir)
    out = tmp_path / "network.json"
    console = Console(file=io.StringIO(), width=160)
    run_network_bench(cfg, out, console)
    assert "sparse / dense" in console.file.getvalue()  # both tables were printed
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "network"
    result = doc["result"]
    assert result["link_bytes_per_s"] > 0 and result["link_source"].startswith("measured")
    (row,) = result["configs"]
    assert (row["model"], row["peers"]) == ("tiny", 2)
    sparse, dense = row["sparseloco"], row["dense"]
    assert dense["bytes_received_per_peer"] == dense_allreduce_bytes(row["params"], 2) == 4 * row["params"]
    # each of the 2 peers fetches the other's 2 shard payloads: k=64 of 4096 values with 2-bit codes and indices
    assert 0 < sparse["bytes_received_per_peer"] < dense["bytes_received_per_peer"] / 50
    assert sparse["bytes_sent_per_peer"] == sparse["bytes_received_per_peer"]  # 2 peers: one serves what the other gets
    for method in (sparse, dense):
        assert method["comm_s_median"] > 0 and method["floor_s"] > 0
        assert method["wall_over_floor"] == method["comm_s_median"] / method["floor_s"]
    if dense["lo_bytes_per_peer"] is not None:  # Linux: the dense payload really crossed the loopback interface
        assert dense["lo_bytes_per_peer"] >= 0.9 * dense["bytes_received_per_peer"]
    assert row["sparse_over_dense_bytes"] < 0.02


def test_tbf_burst_covers_a_full_loopback_packet_and_10_ms_at_high_rates() -> None:
    # tbf cannot pass a packet larger than its bucket: at low rates the 64 KiB loopback packets set the size
    for rate in (1, 20, 100):
        assert tbf_burst_bytes(rate) == 2 * (LO_MTU + 14)
    assert tbf_burst_bytes(1000) == 1_250_000  # 10 ms at 125 MB/s
    assert tbf_burst_bytes(20, mtu=1500) == 25_000  # with ethernet frames, 10 ms at 2.5 MB/s
    rates = [1, 10, 100, 1000, 10_000]
    assert [tbf_burst_bytes(r) for r in rates] == sorted(tbf_burst_bytes(r) for r in rates)


def test_shape_commands_create_the_namespace_raise_lo_and_limit_it() -> None:
    ns = netns_name(1234)
    assert ns == "hlbp-bench-1234"
    add, up, tbf = shape_commands(ns, 100)
    assert add == ["ip", "netns", "add", ns]
    assert up == ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]
    assert tbf == ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100000kbit",
                   "burst", "131100", "latency", "100ms"]
    assert shape_commands(ns, 2.5)[2][12] == "2500kbit"  # fractional Mbit/s keep their value


def test_shaped_argv_reruns_the_same_settings_inside_the_namespace(tmp_path: Path) -> None:
    cfg = NetworkBenchConfig(models=("tiny", "small"), peers=(2, 4), rounds=2, k=32, matchmaking_s=1.5,
                             step_timeout_s=300.0, seed=7, shaped_mbps=20.0)
    argv = shaped_bench_argv(cfg, "hlbp-bench-9", tmp_path / "x.json", threads=1, python="/py")
    assert argv[:7] == ["ip", "netns", "exec", "hlbp-bench-9", "/py", "-m", "hlbp.cli.main"]
    assert argv[7:9] == ["bench", "network"]
    flags = dict(zip(argv[9::2], argv[10::2], strict=True))
    assert flags == {"--models": "tiny,small", "--peers": "2,4", "--rounds": "2", "--k": "32", "--link-probe-mib": "64",
                     "--matchmaking-s": "1.5", "--step-timeout-s": "300.0", "--seed": "7", "--shape-mbps": "20.0",
                     "--inside-netns": "hlbp-bench-9", "--threads": "1", "--out": str((tmp_path / "x.json").resolve())}
    # every flag exists on the command, so the run inside cannot drift from the CLI
    command = typer.main.get_command(bench_app).commands["network"]
    known = {o for p in command.params for o in p.opts}
    assert set(flags) <= known
    assert "--threads" not in shaped_bench_argv(cfg, "n", None, None) and "--out" not in shaped_bench_argv(cfg, "n",
                                                                                                          None, None)
    with pytest.raises(ValueError):
        shaped_bench_argv(NetworkBenchConfig(), "n", None, None)  # not a shaped config


def test_shaping_problem_says_what_to_do() -> None:
    ok = {"ip": "/usr/sbin/ip", "tc": "/usr/sbin/tc"}
    assert shaping_problem(0, ok) is None
    assert "needs root" in shaping_problem(1000, ok)
    msg = shaping_problem(0, {"ip": "/usr/sbin/ip", "tc": None})
    assert "needs tc" in msg and "iproute2" in msg and "\n" not in msg
    with pytest.raises(UserInputError, match="--shape-mbps"):
        NetworkBenchConfig(shaped_mbps=0.0).check()
    with pytest.raises(UserInputError, match="--step-timeout-s"):
        NetworkBenchConfig(step_timeout_s=0.0).check()


def test_shared_link_floor_counts_every_peers_bytes() -> None:
    rounds = [{"comm_s": [1.0, 2.0], "bytes_received": [1e6, 1e6], "bytes_sent": [1e6, 1e6], "lo_tx_bytes": None}]
    alone = summarise(rounds, 4, 1e6, None)
    shared = summarise(rounds, 4, 1e6, None, shared_link=True)
    assert alone["floor_s"] == 1.0 and shared["floor_s"] == 4.0  # 4 peers x 1 MB through one 1 MB/s link
    assert shared["wall_over_floor"] == 0.5


def test_shape_flag_conflicts_are_user_errors() -> None:
    runner = CliRunner()
    both = runner.invoke(bench_app, ["network", "--shape-mbps", "10", "--link-mbps", "10"])
    assert isinstance(both.exception, UserInputError) and "not both" in str(both.exception)
    forged = runner.invoke(bench_app, ["network", "--shape-mbps", "10", "--inside-netns", "hlbp-bench-0"])
    assert isinstance(forged.exception, UserInputError) and "internal" in str(forged.exception)


@pytest.mark.slow
def test_quick_shaped_run_is_limited_by_the_link(tmp_path: Path, cache_dir: Path) -> None:
    problem = shaping_problem(os.geteuid(), {t: shutil.which(t) for t in ("ip", "tc")})
    if problem:
        pytest.skip(f"shaped run impossible here: {problem}")
    cfg = NetworkBenchConfig.quick(rounds=1, matchmaking_s=1.0, cache_dir=cache_dir, shaped_mbps=100.0)
    out = tmp_path / "shaped.json"
    console = Console(file=io.StringIO(), width=160)
    try:
        status = run_shaped(cfg, out, console, threads=1)
    except UserInputError as exc:  # e.g. a kernel without sch_tbf, or namespaces forbidden in this container
        pytest.skip(f"shaped run impossible here: {exc}")
    assert status == 0
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    assert netns_name(os.getpid()) not in listed  # the namespace is gone
    doc = json.loads(out.read_text())
    assert doc["config"]["shaped_mbps"] == 100.0
    result = doc["result"]
    assert result["link_bytes_per_s"] == 12.5e6 and "shared by all N peers" in result["link_source"]
    (row,) = result["configs"]
    dense = row["dense"]
    assert dense["floor_s"] == 2 * dense["bytes_received_per_peer"] / 12.5e6
    # unshaped, the dense exchange takes about a tenth of this floor: at or above it, the link was the limit
    assert dense["wall_over_floor"] > 0.9
    assert dense["lo_bytes_per_peer"] >= 0.9 * dense["bytes_received_per_peer"]  # counted on the namespace's lo
