"""``hlbp bench heterogeneous --network``: the plan and the report arithmetic, and the --quick run end to end
(real processes: a bootstrap, full replicas and pipeline swarms on loopback, three arms)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hlbp.peer.bench.hetnet import DRIVER_TOTAL_STEPS, HetNetBenchConfig, contributor_names, plan, sim_config
from hlbp.peer.bench.hetnet_report import per_round, stage_link_bytes, verdict, weighting_comparison
from hlbp.peer.common.errors import UserInputError


def test_plan_arms_and_weighting_runs() -> None:
    runs = plan(HetNetBenchConfig())
    assert [(r.arm, r.full, r.swarms, r.lockstep) for r in runs] == [
        ("uncompressed", 4, 0, True), ("heterogeneous", 2, 2, True), ("compressed", 0, 4, True)]
    both = plan(HetNetBenchConfig(weighting="both"))
    assert [r.weighting for r in both] == ["equal"] * 4 + ["tokens"]
    assert [r.lockstep for r in both[3:]] == [False, False] and {r.arm for r in both[3:]} == {"heterogeneous"}
    # every arm is R replicas: a swarm is one replica (its driver draws one batch per step)
    for r in runs:
        names, drivers = contributor_names(r, 2)
        assert r.full + len(drivers) == 4 and len(names) == r.full + 2 * r.swarms


def test_lockstep_manifest() -> None:
    cfg = HetNetBenchConfig(weighting="tokens")
    het = plan(cfg)[1]
    sim = sim_config(cfg, het, 6)
    assert sim.min_contributors == 6 and sim.weighting == "tokens" and sim.codec == "subspace-b" and sim.codec_k == 4
    assert 'weighting = "tokens"' in sim.run_toml() and "min_contributors = 6" in sim.run_toml()
    assert sim_config(cfg, plan(cfg)[0], 4).codec == "dense"
    free = plan(HetNetBenchConfig(weighting="both"))[-1]
    assert sim_config(cfg, free, 6).min_contributors == 3  # more than one swarm of 2 stages


def test_every_arm_signs_the_same_inner_schedule_into_its_manifest() -> None:
    from hlbp.peer.bench.hetnet import Run, sim_config

    cfg = HetNetBenchConfig()
    for run in (Run("u", "uncompressed", 4, 0, "equal"), Run("h", "heterogeneous", 2, 2, "equal"),
                Run("c", "compressed", 0, 4, "equal")):
        sim = sim_config(cfg, run, 4)
        assert sim.schedule_total == DRIVER_TOTAL_STEPS
        assert f"schedule_steps = {DRIVER_TOTAL_STEPS}\n" in sim.run_toml()


def test_bad_settings_are_refused() -> None:
    for bad in ({"replicas": 3}, {"variant": "dense"}, {"variant": "nope"}, {"weighting": "stake"},
                {"stages": 1}, {"swarm_wan_mbps": 0.0}):
        with pytest.raises(UserInputError):
            HetNetBenchConfig(**bad).check()


def _rec(r: int, steps: int, val: float | None, accepted: bool = True, sent: int = 100) -> dict:
    return {"round": r, "steps": steps, "val_loss": val, "accepted": accepted, "members": 4, "bytes_sent": sent,
            "bytes_received": sent, "checksums": {"0": "a"}, "in_sync": True}


def test_per_round_tokens_losses_and_bytes() -> None:
    records = {"peer0": [_rec(0, 10, 8.0, sent=300)], "sw0s0": [_rec(0, 7, 8.5, accepted=False)],
               "sw0s1": [_rec(0, 7, None)]}
    (r,) = per_round(records, ["sw0s0"], 1, 256)
    assert r["tokens"] == 17 * 256 and r["accepted_tokens"] == 10 * 256  # the server's steps are not extra tokens
    assert r["full_val_loss"] == 8.0 and r["swarm_val_loss"] == 8.5
    assert r["bytes_per_peer"]["full"]["sent"] == 300 and r["bytes_per_peer"]["stage"]["sent"] == 100


def test_stage_link_bytes() -> None:
    assert stage_link_bytes({}, 2, 0.0)["forward"] == 0.0
    summary = {"tokens": 1000, "stream_bytes": {"sent": {"fwd": 22_000, "eval": 9}, "received": {"bwd": 18_000}}}
    got = stage_link_bytes({"sw0s0": summary, "sw1s0": summary}, 3, 0.5)
    assert got["forward"] == 22.0 and got["backward"] == 18.0 and got["arm_per_token"] == 40.0 * 2 * 0.5
    assert stage_link_bytes({"sw0s0": None}, 2, 1.0)["forward"] is None


def _arm(arm: str, loss: float, lockstep: bool = True, weighting: str = "equal", cut: int = 0) -> dict:
    return {"arm": arm, "final_val_loss": loss, "lockstep": lockstep, "weighting": weighting, "tokens": 1,
            "accepted_tokens": 1, "swarm_phases_cut_short": cut, "rounds": [{"steps": {"peer0": 10, "sw0s0": 6}}]}


def test_verdict() -> None:
    holds = verdict([_arm("uncompressed", 7.0), _arm("heterogeneous", 7.04), _arm("compressed", 7.1)], "b", "1/32")
    assert holds["holds"] is True and abs(holds["ratio"] - 0.4) < 1e-9 and "HOLDS" in holds["line"]
    missed = verdict([_arm("uncompressed", 7.0), _arm("heterogeneous", 7.06), _arm("compressed", 7.1)], "b", "1/32")
    assert missed["holds"] is False and "by 0.0100" in missed["line"]
    flat = verdict([_arm("uncompressed", 7.0), _arm("heterogeneous", 7.0), _arm("compressed", 6.9)], "b", "1/32")
    assert flat["holds"] is None
    lossless = verdict([_arm("uncompressed", 7.0), _arm("heterogeneous", 7.1), _arm("compressed", 7.1)], "a", "1/32")
    assert lossless["holds"] is False and "lossless" in lossless["line"]
    # the free-running runs never count for the claim
    extra = [_arm("heterogeneous", 9.0, lockstep=False)]
    assert verdict([_arm("uncompressed", 7.0), _arm("heterogeneous", 7.04), _arm("compressed", 7.1), *extra],
                   "b", "1/32")["holds"] is True


def test_weighting_comparison() -> None:
    assert weighting_comparison([_arm("heterogeneous", 7.0)]) is None
    got = weighting_comparison([_arm("heterogeneous", 7.0, False, "equal", cut=2),
                                _arm("heterogeneous", 6.9, False, "tokens", cut=1)])
    assert got is not None and abs(got["tokens_minus_equal"] + 0.1) < 1e-9
    assert got["equal"]["mean_steps_full"] == 10 and got["equal"]["mean_steps_swarm"] == 6


@pytest.mark.slow
def test_quick_network_bench(tmp_path) -> None:
    out, png = tmp_path / "hetnet.json", tmp_path / "curve.png"
    run = subprocess.run([sys.executable, "-m", "hlbp.cli.main", "bench", "heterogeneous", "--network", "--quick",
                          "--out", str(out), "--plot", str(png)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    doc = json.loads(out.read_text())
    runs = {r["arm"]: r for r in doc["result"]["runs"]}
    assert list(runs) == ["uncompressed", "heterogeneous", "compressed"]
    assert (runs["uncompressed"]["full_replicas"], runs["heterogeneous"]["swarms"], runs["compressed"]["swarms"]) \
        == (2, 1, 2)
    nominal = 2 * 3 * 5 * 4 * 64  # R x rounds x H x batch x seq_len
    for r in runs.values():
        assert r["tokens"] == r["accepted_tokens"] == r["nominal_tokens"] == nominal  # the same token budget
        assert r["final_state_verified"] and r["checksums_equal"]
        assert len(r["rounds"]) == 3 and r["final_val_loss"] is not None and r["seconds"] > 0
        assert r["bytes_per_round_per_peer"]["sent"] > 0
    assert runs["uncompressed"]["stage_link_bytes_per_token"]["forward"] == 0.0
    assert runs["uncompressed"]["stage_link_bytes_per_token"]["arm_per_token"] == 0.0
    for arm in ("heterogeneous", "compressed"):
        link = runs[arm]["stage_link_bytes_per_token"]
        assert link["forward"] > 0 and link["backward"] > 0 and link["arm_per_token"] > 0
        assert all(v is not None for v in runs[arm]["val_loss_curve"]["swarm_chain"])
    # k = 4 fp32 values are 16 B a token each way; dense bf16 would be 256: compression shows on the wire
    assert runs["compressed"]["stage_link_bytes_per_token"]["forward"] < 64
    # the plain score here and the full replicas' own score of the same parameters agree
    het = runs["heterogeneous"]
    assert abs(het["final_val_loss"] - het["final_full_val_loss"]) < 1e-3
    v = doc["result"]["verdict"]
    assert v["holds"] in (True, False, None) and v["line"] in run.stdout + run.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_round_noise() -> None:
    from hlbp.peer.bench.hetnet_report import round_noise

    assert round_noise([7.0, 6.9]) is None
    assert round_noise([7.0, 6.9, 6.8, 6.7, 6.6]) == pytest.approx(0.0, abs=1e-12)  # a straight trend is no noise
    assert round_noise([7.0, 7.1, 7.0, 7.1, 7.0]) > 0.05


def test_replicates_of_the_heterogeneous_arm() -> None:
    runs = [_arm("uncompressed", 7.0), _arm("heterogeneous", 7.03), _arm("compressed", 7.1),
            _arm("heterogeneous", 7.05, lockstep=False), _arm("heterogeneous", 7.08, lockstep=False, cut=1)]
    rep = verdict(runs, "b", "1/32")["replicates"]
    assert rep["runs"] == 2 and rep["mean"] == pytest.approx(7.04)  # the run with a swarm cut short is no repeat
    assert rep["holds"] is True and "holds" in rep["line"]
    assert verdict(runs[:3], "b", "1/32")["replicates"] is None
