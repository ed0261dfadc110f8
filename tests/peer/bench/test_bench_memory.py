"""`hlbp bench memory --quick` as the CLI runs it: real full replicas and a 2-stage swarm of the tiny model through
two overlapped rounds, each peer's peak above its pre-model baseline per trained parameter, and the projection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hlbp.peer.bench.memory import marginal, peak_memory, require_roles, role_budget

pytestmark = pytest.mark.slow


def test_the_worst_peer_of_each_role_sets_its_budget() -> None:
    rounds = [{"memory": {"peer0": {"peak_host_bytes": 300, "base_host_bytes": 100, "trained_params": 10},
                          "peer1": {"peak_host_bytes": 250, "base_host_bytes": 100, "trained_params": 10},
                          "sw0s0": {"peak_host_bytes": 140, "base_host_bytes": 100, "trained_params": 4}}},
              {"memory": {"peer1": {"peak_host_bytes": 420, "base_host_bytes": 100, "trained_params": 10}}}]
    memory = peak_memory(rounds)
    assert memory["peer1"]["peak_host_bytes"] == 420  # the largest over the rounds
    full, stage = role_budget(memory, stage=False), role_budget(memory, stage=True)
    assert full["peer"] == "peer1" and full["peak_host_bytes_per_param"] == 32.0
    assert full["per_peer"] == {"peer0": 20.0, "peer1": 32.0}
    assert stage["peer"] == "sw0s0" and stage["peak_host_bytes_per_param"] == 10.0
    assert role_budget({"peer0": {"peak_host_bytes": 1, "base_host_bytes": 1, "trained_params": 0}}, False) is None


def test_the_marginal_cost_of_a_parameter_ignores_what_every_process_holds() -> None:
    def role(peak, base, n, device=0):
        return {"peak_host_bytes": peak, "base_host_bytes": base, "trained_params": n, "peak_device_bytes": device}

    # a fixed 600 bytes above the baseline whatever the model, then 8 bytes per parameter on the host
    runs = [{"preset": "b", "full_replica": role(1000 + 600 + 8 * 300, 1000, 300, 20 * 300), "stage_peer": None},
            {"preset": "a", "full_replica": role(900 + 600 + 8 * 100, 900, 100, 20 * 100),
             "stage_peer": role(10, 5, 50)}]
    (slope,) = marginal(runs)
    assert (slope["role"], slope["from"], slope["to"], slope["params"]) == ("full_replica", "a", "b", 200)
    assert slope["host_bytes_per_param"] == 8.0 and slope["device_bytes_per_param"] == 20.0
    assert marginal(runs[:1]) == []


def test_memory_bench_measures_both_roles_through_agreed_rounds(tmp_path: Path, builtin_data: object) -> None:
    out = tmp_path / "memory.json"
    # every peer recomputes its blocks in the backward (--recompute): replicas and stages still agree every round
    proc = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "memory", "--quick", "--recompute", "--out",
                           str(out)], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (run,) = doc["result"]["runs"]
    assert run["preset"] == "tiny" and run["rounds"] == run["rounds_agreed"] == 2
    assert doc["config"]["recompute"] is True
    assert set(run["compute_s"]) == {"full_replica", "stage_peer"} and min(run["compute_s"].values()) > 0
    (cost,) = doc["result"]["recompute_step"]  # what recomputing costs a step, timed beside a step without it
    assert cost["preset"] == "tiny" and cost["held_s"] > 0 and cost["recomputed_s"] > 0
    assert 0 < cost["recomputed_bytes_per_param"] < cost["held_bytes_per_param"]
    assert cost["ratio"] == cost["recomputed_s"] / cost["held_s"]
    full, stage = run["full_replica"], run["stage_peer"]
    assert full["trained_params"] == run["n_params"] > stage["trained_params"] > 0
    for role in (full, stage):
        # the measured peak is above the baseline (the state is real memory) and the baseline holds no model
        assert role["peak_host_bytes"] > role["base_host_bytes"] > 100 << 20
        assert 4 < role["peak_host_bytes_per_param"] < 1000
    projected = {p["preset"]: p for p in doc["result"]["projection"]}
    assert set(projected) == {"350m", "1b"} and projected["1b"]["params"] > 1e9
    assert projected["1b"]["host_gib"] > projected["350m"]["host_gib"] > 0



def test_a_run_whose_peers_failed_is_an_error_not_an_empty_table() -> None:
    stage_only = {"sw0s0": {"peak_host_bytes": 140, "base_host_bytes": 100, "trained_params": 4}}
    with pytest.raises(RuntimeError, match=r"measured no full replica \(exit codes: \{'peer0': 1\}\)"):
        require_roles("small", stage_only, {"peer0": 1, "sw0s0": 0})
    with pytest.raises(RuntimeError, match="measured no full replica and no stage peer .no round recorded"):
        require_roles("small", {}, {"peer0": None})
    require_roles("small", {**stage_only, "peer0": {"peak_host_bytes": 9, "base_host_bytes": 1,
                                                    "trained_params": 1}}, {})
