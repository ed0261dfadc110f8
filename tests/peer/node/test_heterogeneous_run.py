"""Full replicas and a pipeline swarm in the same SparseLoCo rounds, as real ``hlbp join`` processes on loopback.

Two full replicas contribute both shards of a 2-stage partition; a swarm of two stage peers contributes shard 0
(its driver) and shard 1 (its server). After every round each shard's checksum is the same on every peer that
holds it, the stage peers' contributions are in the accepted set, and both the full replicas' and the swarm's
validation losses fall (the swarm scores its whole model through its chain).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hlbp.peer.sim.launcher import SimConfig
from hlbp.peer.sim.run import run_simulation

pytestmark = pytest.mark.slow

ROUNDS = 4
# The swarm lands a second or two after the full replicas here (its steps cross two processes), and on a loaded
# 2-core CI box that lag jumps from round to round; a round's window then left the swarm out once in a CI run. The
# claim here is that all four contributions combine every round, so the window's floor is kept above that jitter.
# It costs nothing while all four are on time: the coordinator closes as soon as every expected one is in.
FLOOR_S = 8.0  # 4 s left the swarm out (5 of its 8 steps done) with a second process test beside it


def test_full_replicas_and_a_swarm_agree_per_shard_and_all_learn(tmp_path: Path) -> None:
    cfg = SimConfig(n_full=2, n_swarms=1, n_stages=2, rounds=ROUNDS, inner_steps=8, batch_size=4, seq_len=64,
                    run_id="hetero", ttl_s=10.0, seed=3, round_deadline_s=FLOOR_S, min_deadline_s=FLOOR_S)
    report = run_simulation(cfg, tmp_path, timeout_s=300)
    assert not report["timed_out"], report
    assert report["rounds_completed"] == ROUNDS, report["rounds"]
    for r in report["rounds"]:
        # every peer that holds a shard ended the round with the same checksum of it, and everybody is in sync
        assert r["checksums_equal"] and r["in_sync"], r
        assert r["members"] == 4 and set(r["accepted"]) == {"peer0", "peer1", "sw0s0", "sw0s1"}, r
        assert r["shards"] == {"peer0": ["0", "1"], "peer1": ["0", "1"], "sw0s0": ["0"], "sw0s1": ["1"]}, r
    full = [r["full_val_loss"] for r in report["rounds"]]
    swarm = [r["swarm_val_loss"]["sw0s0"] for r in report["rounds"]]
    assert full[-1] < full[0] - 0.3 and swarm[-1] < swarm[0] - 0.3, (full, swarm)
    # the swarm scores the same global parameters as the full replicas (up to its bf16 activation wire format)
    assert all(abs(a - b) < 0.05 for a, b in zip(full, swarm)), (full, swarm)
