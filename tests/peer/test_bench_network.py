"""`hlbp bench network` in process, cut down: real p2pd peers, both methods measured, and the bytes add up."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from hlbp.peer.bench.network import NetworkBenchConfig, dense_allreduce_bytes, run_network_bench


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
