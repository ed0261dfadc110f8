"""`hlbp bench scale` as the CLI runs it, shrunk to one small swarm: a process run under a cap, the simulator at
N = 1000 with churn, the apply costs at 1b sizes, the JSON's runs and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.slow


def test_scale_bench_writes_processes_simulated_runs_costs_and_plot(tmp_path: Path, builtin_data: object) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "scale", "--quick", "--sizes", "3",
                           "--gather", "2", "--reserves", "1", "--rounds", "3", "--out", str(out)],
                          check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["result"]["runs"]
    assert [(r["mode"], r["n"]) for r in runs] == [("processes", 3), ("simulated", 1000),
                                                   ("simulated, members serve", 1000)]
    keys = {"mode", "n", "recv_bytes_per_peer_round", "sent_bytes_per_peer_round", "records_per_peer_round",
            "rounds", "rounds_agreed"}
    assert all(keys <= set(r) for r in runs)
    real, sim, members_serve = runs
    assert real["rounds"] == real["rounds_agreed"] == 3 and real["accepted_per_round"] == [2, 2, 2]
    assert real["committee"] == 6  # round 2 ran with a committee (drawn from round 0's members)
    # three replicas, two places: each peer fetched at most the two selected payloads (48 KB each) a round, and
    # round records were counted
    assert 0 < real["recv_bytes_per_peer_round"] <= 2 * 50_000 and real["records_per_peer_round"] > 0
    assert real["wall_s"] > 0
    assert sim["rounds_closed"] == sim["rounds_agreed"] == 10
    assert sim["max_payloads_fetched_one_peer_round"] <= 3
    assert sim["committee"] == 32 and sim["max_records_one_peer_round"] <= 64 and sim["records_per_peer_round"] < 10
    # the fetch trees bound what one peer uploads; members serving every peer upload about N payloads each
    assert members_serve["max_sent_bytes_one_peer_round"] > 5 * sim["max_sent_bytes_one_peer_round"]
    cost = doc["result"]["costs"][0]
    assert cost["contributors"] == 3 and cost["params"] > 1e9 and cost["total_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
