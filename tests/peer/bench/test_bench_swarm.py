"""``hlbp bench swarm``: the comparison arithmetic, and the --quick run end to end (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hlbp.peer.bench.swarm import SwarmBenchConfig, compare, method_summary, overlap_comparison
from hlbp.peer.common.errors import UserInputError


def _report(sent: float, comm: float, vals: list[float], exact: bool) -> dict:
    return {"rounds": [{}, {}], "rounds_completed": 2, "val_loss": vals, "states_agree": [True, True],
            "checksums_equal": [exact, exact], "bytes_per_peer_round": {"sent": sent, "received": sent},
            "time_s": {"comm": 2 * comm, "wait": 0.5, "compute": 4.0}, "utilization": 0.8, "seconds": 30.0}


def test_summary_and_ratios() -> None:
    sparse = method_summary(_report(50_000.0, 0.2, [9.0, 8.5], True))
    dense = method_summary(_report(11_600_000.0, 0.4, [8.0, 7.5], False))
    assert sparse["comm_s_per_round"] == 0.2 and sparse["final_val_loss"] == 8.5 and sparse["bit_identical"]
    assert dense["states_agree"] and not dense["bit_identical"]
    ratios = compare(sparse, dense)
    assert ratios["comm_s"] == 0.5 and abs(ratios["bytes_sent"] - 50_000 / 11_600_000) < 1e-12
    assert compare({**sparse, "final_val_loss": None}, dense)["val_loss"] is None


def test_overlap_comparison_and_modes() -> None:
    none = method_summary(_report(50_000.0, 0.25, [9.0, 8.0], True))
    eager = {**method_summary(_report(50_000.0, 0.05, [9.0, 8.08], True)), "utilization": 0.97}
    rows = overlap_comparison({"sparseloco overlap none": none, "sparseloco overlap eager": eager})
    assert rows["none"]["val_loss_vs_none"] == 1.0 and rows["eager"]["val_loss_vs_none"] == pytest.approx(1.01)
    assert rows["eager"]["comm_wait_s"] == pytest.approx(0.05 + 0.25) and rows["eager"]["utilization"] == 0.97
    for bad in (("none", "none"), ("late",)):
        with pytest.raises(UserInputError):
            SwarmBenchConfig(overlaps=bad).check()


@pytest.mark.slow
def test_quick_swarm_bench(tmp_path) -> None:
    out = tmp_path / "swarm.json"
    run = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "swarm", "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    sparse, dense = doc["result"]["methods"]["sparseloco"], doc["result"]["methods"]["diloco"]
    assert sparse["rounds_completed"] == dense["rounds_completed"] == 2
    assert sparse["bit_identical"] and dense["states_agree"]
    assert doc["result"]["sparse_over_dense"]["bytes_sent"] < 0.01  # 2 replicas: about 1/250
    assert "sparse / dense" in run.stdout + run.stderr
