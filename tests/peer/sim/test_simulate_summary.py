"""The simulate report as a pure function of metrics records: no processes."""

from __future__ import annotations

from typing import Any

from hlbp.peer.sim.launcher import checksums_agree, summarize
from hlbp.peer.sim.report import audit_summary


def _rec(r: int, sums: dict[str, str], val: float, sent: int, in_sync: bool = True) -> dict[str, Any]:
    return {"event": "round", "round": r, "contributed": True, "accepted": True, "members": 2, "compute_s": 3.0,
            "comm_s": 1.0, "wait_s": 0.5, "bytes_sent": sent, "bytes_received": 2 * sent, "in_sync": in_sync,
            "checksums": sums, "val_loss": val, "steps": 10}


def test_summary_per_round_and_dense_ratio() -> None:
    records = {
        "p0": [_rec(0, {"0": "x", "1": "y"}, 9.0, 100), _rec(1, {"0": "z", "1": "w"}, 8.0, 300)],
        "p1": [_rec(0, {"0": "x", "1": "y"}, 9.2, 100), _rec(1, {"0": "DIFF", "1": "w"}, 8.2, 300)],
    }
    report = summarize(records, n_params=1000, target_rounds=2)
    assert report["rounds_completed"] == 2
    assert report["checksums_equal"] == [True, False]
    assert report["val_loss"] == [9.1, 8.1]
    assert report["rounds"][1]["bytes_sent"] == {"p0": 300, "p1": 300}
    assert report["utilization"] == 0.75
    assert report["bytes_per_peer_round"]["sent"] == 200
    assert report["dense_fp32_bytes_per_peer_round"] == 4000 and report["compression_ratio"] == 20


def test_out_of_sync_records_do_not_count_against_agreement() -> None:
    recs = [_rec(0, {"0": "a"}, 1.0, 1), _rec(0, {"0": "a"}, 1.0, 1), _rec(0, {"0": "b"}, 1.0, 1, in_sync=False)]
    assert checksums_agree(recs)
    assert not checksums_agree([])


def test_a_resync_record_describes_a_later_round_and_is_not_compared_with_its_own() -> None:
    # a straggler that could no longer fetch round 1 loaded round 3: its round-1 record holds round 3's state
    late = {**_rec(1, {"0": "round3"}, 7.0, 0), "synced": True, "state_round": 3}
    records = {"p0": [_rec(1, {"0": "round1"}, 9.0, 100)], "p1": [_rec(1, {"0": "round1"}, 8.0, 100)], "slow": [late]}
    r = summarize(records)["rounds"][0]
    assert r["checksums_equal"] and r["states_agree"]
    assert r["val_loss"] == 8.5 and r["resynced"] == {"slow": 3}
    assert not checksums_agree([_rec(1, {"0": "round1"}, 9.0, 1), {**late, "state_round": None}])
    assert not checksums_agree([late])  # nothing left to compare


def test_dense_allreduce_baseline_counts_both_ways() -> None:
    records = {f"p{i}": [{**_rec(0, {"0": "x"}, 9.0, 100), "members": 4}] for i in range(4)}
    report = summarize(records, n_params=1000)
    # 2 (N-1)/N x 4 B x params with N = 4 members, against the larger of sent and received (200 B)
    assert report["dense_allreduce_bytes_per_peer_round"] == 6000
    assert report["allreduce_ratio"] == 30


def test_checksums_agree_shard_by_shard_with_stage_peers_holding_one_shard() -> None:
    full = [_rec(0, {"0": "a", "1": "b"}, 1.0, 1), _rec(0, {"0": "a", "1": "b"}, 1.0, 1)]
    assert checksums_agree([*full, _rec(0, {"1": "b"}, 1.0, 1), _rec(0, {"0": "a"}, 1.0, 1)])
    assert not checksums_agree([*full, _rec(0, {"1": "other"}, 1.0, 1)])


def test_report_splits_validation_and_utilization_by_role() -> None:
    records = {"peer0": [_rec(0, {"0": "a", "1": "b"}, 9.0, 10)], "sw0s0": [_rec(0, {"0": "a"}, 9.5, 10)],
               "sw0s1": [{**_rec(0, {"1": "b"}, 1.0, 10), "val_loss": None}]}
    r = summarize(records)["rounds"][0]
    assert r["full_val_loss"] == 9.0 and r["swarm_val_loss"] == {"sw0s0": 9.5}
    assert set(r["utilization_by_role"]) == {"full", "stage"}
    assert r["shards"] == {"peer0": ["0", "1"], "sw0s0": ["0"], "sw0s1": ["1"]}


def test_the_run_is_split_by_role_into_utilization_and_busy_share_of_wall_time() -> None:
    full = [{**_rec(r, {"0": "a"}, 9.0, 10), "compute_s": 2.0, "comm_s": 0.5, "wait_s": 1.5} for r in range(2)]
    stage = [{**_rec(r, {"0": "a"}, 9.0, 10), "compute_s": 3.0, "comm_s": 1.0, "wait_s": 0.0} for r in range(2)]
    roles = summarize({"peer0": full, "sw0s0": stage, "sw0s1": stage})["by_role"]
    assert roles["full"] == {"compute_s": 4.0, "comm_s": 1.0, "wait_s": 3.0, "utilization": 0.8, "busy": 0.5}
    assert roles["stage"] == {"compute_s": 12.0, "comm_s": 4.0, "wait_s": 0.0, "utilization": 0.75, "busy": 0.75}
    assert set(summarize({"peer0": full})["by_role"]) == {"full"}


def test_inner_steps_waiting_for_their_turn_count_as_waiting_not_compute() -> None:
    full = [{**_rec(r, {"0": "a"}, 9.0, 10), "compute_s": 2.0, "comm_s": 0.5, "wait_s": 1.0, "turn_wait_s": 0.5}
            for r in range(2)]
    report = summarize({"peer0": full})
    assert report["by_role"]["full"] == {"compute_s": 4.0, "comm_s": 1.0, "wait_s": 3.0, "utilization": 0.8,
                                         "busy": 0.5}
    assert [r["turn_wait_s"] for r in report["rounds"]] == [0.5, 0.5]
    assert report["time_s"]["turn_wait"] == 1.0


def test_phases_are_averaged_per_peer_and_round() -> None:
    a, b = _rec(0, {"0": "x"}, 9.0, 100), _rec(0, {"0": "x"}, 9.0, 100)
    a["phases"] = {"close": 1.0, "verify": 0.5}
    b["phases"] = {"close": 3.0}  # a round without a verify step (left out) counts as 0 s of it
    assert summarize({"p0": [a], "p1": [b]})["phases_s"] == {"close": 2.0, "verify": 0.25}


def test_the_audit_summary_counts_findings_and_sets_their_cost_against_the_stage_peers_compute() -> None:
    audits = [{"event": "audit", "guilty": False, "seconds": 0.05, "compute_s": 0.01,
               "samples": [{"finding": "clean"}, {"finding": "clean"}]},
              {"event": "audit", "guilty": True, "seconds": 0.15, "compute_s": 0.03,
               "samples": [{"finding": "forward"}, {"finding": "stale"}]},
              {"event": "audit", "guilty": False, "seconds": 0.0, "compute_s": 0.0, "samples": []}]
    out = audit_summary(audits, stage_busy_s=4.0)
    assert (out["audits"], out["guilty"]) == (3, 1)
    assert out["findings"] == {"clean": 2, "forward": 1, "stale": 1}
    assert abs(out["compute_share"] - 0.01) < 1e-12 and abs(out["wall_share"] - 0.05) < 1e-12
    assert audit_summary([], 0.0)["compute_share"] is None
