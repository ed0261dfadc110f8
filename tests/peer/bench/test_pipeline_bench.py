"""``hlbp bench pipeline``: the --quick run end to end (real stage processes, p2pd and WAN-emulating proxies)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hlbp.peer.bench.pipeline import (
    QUICK_CODECS,
    WARM_STEPS,
    PipelineBenchConfig,
    driver_identity,
    formula_bytes,
    parse_codec,
    schedule_ratios,
    stage_peer_ratios,
)
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.node.join import data_rank
from hlbp.protocol.identity import Identity


def test_codec_specs_and_formula() -> None:
    assert parse_codec("dense", 128) == ("dense", 128, "1")
    assert parse_codec("subspace-a@1/32", 128) == ("subspace-a", 4, "1/32")
    assert parse_codec("subspace-b@1/128", 128)[1] == 1
    assert formula_bytes("dense", 128) == {"forward": 258, "backward": 256}  # bf16 values plus u16 targets
    assert formula_bytes("subspace-a", 4) == {"forward": 20, "backward": 16}  # fp32 values, u16 ids and targets


def test_the_driver_key_follows_the_seed_so_every_codec_sees_the_same_batches() -> None:
    assert driver_identity(0) == driver_identity(0) != driver_identity(1)
    ranks = {data_rank(Identity.from_file_bytes(driver_identity(seed)).peer_id) for seed in range(4)}
    assert len(ranks) == 4  # a seed picks the data order; the same seed, the same order


@pytest.mark.parametrize("schedules", [(), ("1f1b",), ("tapered", "tapered")])
def test_the_schedules_must_be_known_and_distinct(schedules: tuple[str, ...]) -> None:
    with pytest.raises(UserInputError, match="--schedules"):
        PipelineBenchConfig(schedules=schedules).check()
    PipelineBenchConfig(schedules=("uniform", "tapered")).check()


def test_a_codec_run_under_both_schedules_is_compared() -> None:
    def row(codec: str, schedule: str, tps: float, busy: float, loss: float) -> dict:
        return {"codec": codec, "schedule": schedule, "tokens_per_s": tps, "bottleneck_busy": busy,
                "val_loss": loss}

    rows = [row("dense", "tapered", 300.0, 0.1, 8.0), row("subspace-a@1/128", "tapered", 4400.0, 0.84, 7.5356),
            row("subspace-a@1/128", "uniform", 4000.0, 0.82, 7.5358)]
    (only,) = schedule_ratios(rows)  # dense ran under one schedule: nothing to compare
    assert only["codec"] == "subspace-a@1/128" and only["tokens_per_s_ratio"] == pytest.approx(1.1)
    assert only["busy_points"] == pytest.approx(2.0)
    assert only["val_loss"] == {"tapered": 7.5356, "uniform": 7.5358}


def test_runs_with_more_peers_on_the_slow_stage_are_compared_with_one() -> None:
    def row(schedule: str, peers: int, tps: float) -> dict:
        return {"codec": "c", "schedule": schedule, "stage_peers": peers, "tokens_per_s": tps, "val_loss": 7.5}

    rows = [row("uniform", 1, 400.0), row("uniform", 2, 680.0), row("tapered", 2, 500.0)]
    (only,) = stage_peer_ratios(rows)  # tapered ran with two peers only: nothing to compare
    assert only["peers"] == 2 and only["tokens_per_s_ratio"] == pytest.approx(1.7) and only["met"]
    assert only["steady_tokens_per_s_ratio"] is None  # rows without a steady rate: none
    steady = [{**row("uniform", 1, 400.0), "tokens_per_s_steady": 500.0},
              {**row("uniform", 2, 440.0), "tokens_per_s_steady": 800.0}]
    assert stage_peer_ratios(steady)[0]["steady_tokens_per_s_ratio"] == pytest.approx(1.6)
    assert not stage_peer_ratios([row("uniform", 1, 400.0), row("uniform", 2, 560.0)])[0]["met"]
    assert schedule_ratios([row("uniform", 1, 1.0), row("tapered", 2, 1.0)]) == []  # only one-peer runs compare


@pytest.mark.parametrize(("changes", "flag"), [({"stage_peers": ()}, "--stage-peers"),
                                               ({"stage_peers": (1, 1)}, "--stage-peers"),
                                               ({"stage_peers": (5,)}, "--stage-peers"),
                                               ({"slow_stage": 0}, "--slow-stage"),
                                               ({"slow_stage": 3}, "--slow-stage"),
                                               ({"slow_stage_factor": 0.5}, "--slow-stage-factor")])
def test_the_stage_peer_settings_must_run(changes: dict, flag: str) -> None:
    with pytest.raises(UserInputError, match=flag):
        PipelineBenchConfig(**changes).check()


@pytest.mark.slow
def test_quick_stage_peers_arm_splits_a_slow_stage_between_two_peers(tmp_path) -> None:
    out = tmp_path / "pipeline.json"
    run = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "pipeline", "--quick", "--codecs",
                          "subspace-a@1/32", "--stage-peers", "1,2", "--slow-stage-factor", "120", "--wan-mbps", "100",
                          "--out", str(out)], capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["stage_peers"]: r for r in doc["result"]["rows"]}
    assert set(rows) == {1, 2} and all(r["steps"] == doc["config"]["steps"] for r in rows.values())
    assert all(r["bottleneck"] == "stage 1" for r in rows.values()), rows  # the sleep made it the bottleneck
    # at 100 Mbit/s tiny's stage-1 gradient trades in a tenth of a second: the driver judged sharing pays
    assert (rows[1]["served_by"], rows[2]["served_by"]) == (1, 2), rows
    (ratio,) = doc["result"]["stage_peer_ratios"]
    # each stage-1 peer sleeps through half the micro-batches: once warm, the swarm is faster, whatever else the
    # box runs (the first steps pay each peer's one-time costs, two peers' at once, and are left out)
    per_step = doc["config"]["batch_size"] * doc["config"]["seq_len"]
    for r in rows.values():  # the steady rate: the tokens of the steps after the warm-up over their seconds
        assert r["warm_steps"] == WARM_STEPS and r["tokens"] == per_step * r["steps"]
        assert r["tokens_per_s_steady"] == pytest.approx(
            per_step * (r["steps"] - WARM_STEPS) / sum(r["step_seconds"][WARM_STEPS:])), r
    assert ratio["steady_tokens_per_s_ratio"] > 1.1, ratio
    assert "2 peers on stage 1 against one" in run.stdout + run.stderr


@pytest.mark.slow
def test_quick_pipeline_bench(tmp_path) -> None:
    out = tmp_path / "pipeline.json"
    run = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "pipeline", "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["codec"]: r for r in doc["result"]["rows"]}
    assert set(rows) == set(QUICK_CODECS)
    for r in rows.values():
        assert r["steps"] == doc["config"]["steps"] and r["tokens_per_s"] > 0
        assert r["bytes_per_token"]["forward"] > 0 and r["bytes_per_token"]["backward"] > 0
        assert r["val_loss"] is not None and 0 < r["bottleneck_busy"] <= 1.5
    driver = Identity.from_file_bytes(driver_identity(doc["config"]["seed"])).peer_id
    assert {r["data_rank"] for r in rows.values()} == {data_rank(driver)}  # every codec trained on the same batches
    dense, sub = rows["dense"], rows["subspace-a@1/32"]
    # measured bytes are the payload plus headers: never below the formula, and the codec is far smaller
    assert dense["bytes_per_token"]["forward"] >= dense["formula_bytes_per_token"]["forward"]
    assert sub["bytes_per_token"]["forward"] < dense["bytes_per_token"]["forward"] / 8
    assert "x dense" in run.stdout + run.stderr
