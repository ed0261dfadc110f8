"""Overlapped rounds between real processes: 3 full replicas whose exchanges run beside the next inner phase."""

from __future__ import annotations

import itertools
import json

import pytest

from hlbp.peer.sim.launcher import SimConfig
from hlbp.peer.sim.run import run_simulation

pytestmark = pytest.mark.slow


def test_eager_overlap_keeps_every_round_agreed_and_the_loss_falling(tmp_path) -> None:
    """Every replica contributes to every round (no straggler, no resync), the global parameters' checksums agree
    after every round although each replica trains from its own eager start, and the loss falls."""
    cfg = SimConfig(n_full=3, rounds=4, inner_steps=5, batch_size=4, seq_len=64, round_deadline_s=5.0,
                    min_deadline_s=1.0, max_deadline_s=20.0, seed=3, threads=1, run_id="overlap-test", ttl_s=10.0,
                    overlap="eager")
    report = run_simulation(cfg, tmp_path, 240.0)
    assert report["rounds_completed"] == 4 and all(report["checksums_equal"]), report["exit_codes"]
    for r in report["rounds"]:
        assert len(r["accepted"]) == 3, r
        assert r["members"] == 3
    assert not any("discarding the inner phase" in p.read_text() for p in tmp_path.glob("*.log"))
    assert not any("out of sync" in p.read_text() for p in tmp_path.glob("*.log"))
    # a result lands mid-phase only where its exchange ends before the phase does: not in every round on a loaded
    # machine, but after 1 to H steps whenever it does
    landed = [n for r in report["rounds"] for n in r["landed_after"].values()]
    assert all(1 <= n <= 5 for n in landed), landed
    # partial results land before the result itself, in step order: a replica that announced before the others
    # takes in their contributions as it fetches them
    for r in report["rounds"]:
        for name, steps in r["previews"].items():
            assert steps == sorted(steps) and all(1 <= n <= 5 for n in steps), (name, steps)
            assert r["landed_after"].get(name, 5) >= steps[-1], (name, steps, r["landed_after"])
    assert report["landing"]["partial"] > 0, report["landing"]
    assert report["landing"]["mid_phase"] == len(landed) / sum(r["peers"] for r in report["rounds"])
    # what the exchange's turns cost each phase is in every round record, apart from its compute
    records = [json.loads(line) for f in tmp_path.glob("*/*/*/metrics.jsonl") for line in f.read_text().splitlines()]
    rounds = [rec for rec in records if rec.get("event") == "round"]
    assert rounds and all(rec["turn_wait_s"] >= 0 for rec in rounds)
    losses = report["val_loss"]
    # every round lowers the loss; by how much varies with load (a loaded run measured 8.86 -> 8.36)
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] - 0.25, losses
