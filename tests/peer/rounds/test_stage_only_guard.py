"""Rounds that only stage peers hold are scored by their swarms: real ``hlbp join`` processes on loopback, two
2-stage swarms and no full replica, so each shard has two contributions a round (too few for the median rule) and
nobody holds the whole model. The stage-1 peer of the second swarm sends every contribution sign-flipped at 7.9x its
shard's parameter norm (under the 8x bound), from round 0.

What must hold: each swarm's driver scores every round's candidate result on the run's guard batch through its
chain, and every stage peer, of either swarm, records the same loss and judges its shard by it before it commits (the refusal of a candidate past the bounds is shown in process, with real daemons, in
tests/peer/swarm/test_swarm_guard.py); the near-bound poison moves nothing the guard would see: its influence is
clipped to the round's median norm, the update of its shard stays under the parameters' norm, the guard batch's loss
falls every round, and so does the validation loss."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from faulty_peer import program

from hlbp.peer.sim.launcher import Replica, SimConfig, Swarm, poll
from hlbp.peer.train.metricslog import read_metrics

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0  # a bound on a few rounds of four stage peers on 2 busy cores, not an expected duration
ROUNDS = 3


def _rounds(peer: Replica) -> list[dict[str, Any]]:
    path = peer.metrics_path()
    return [r for r in read_metrics(path) if r.get("event") == "round"] if path is not None and path.exists() else []


def test_stage_only_rounds_are_scored_through_both_chains_and_a_near_bound_poison_moves_nothing(tmp_path: Path) -> None:
    cfg = SimConfig(n_full=0, n_stages=2, inner_steps=4, batch_size=4, seq_len=64, seed=4, run_id="stage-guard",
                    ttl_s=8.0, micro_batches=2)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add_stage("a1", 1, swarm=0).proc.wait_for("^announced", 60)
        sw.add_stage("b1", 1, swarm=1, program=program("near-bound:7.9")).proc.wait_for("^announced", 60)
        sw.add_stage("a0", 0, "--micro-batches", "2", swarm=0)
        sw.add_stage("b0", 0, "--micro-batches", "2", swarm=1)
        names = ("a0", "a1", "b0", "b1")
        try:
            poll(lambda: all(len(_rounds(sw.replicas[n])) >= ROUNDS for n in names), TIMEOUT_S,
                 f"every stage peer to finish {ROUNDS} rounds")
        except TimeoutError as exc:
            logs = "\n".join(f"--- {n}\n{sw.replicas[n].proc.output[-2500:]}" for n in names)
            raise AssertionError(f"{exc}\n{logs}") from None
        sw.replicas["b1"].proc.wait_for("near-bound contribution to round 0", 10)
        records = {n: {r["round"]: r for r in _rounds(sw.replicas[n])} for n in names}

    assert all(records["b1"][r]["guard"]["contribution"] > 7.5 for r in range(ROUNDS)), records["b1"]  # the lie
    for r in range(ROUNDS):
        recs = [records[n][r] for n in names]
        assert all(rec["members"] == 4 and rec["accepted"] and not rec["refused"] for rec in recs), (r, recs)
        # both chains scored the same candidate: the same loss on every peer
        assert len({rec["guard"]["loss"] for rec in recs}) == 1, (r, recs)
        assert all(rec["guard"]["update"] < 1.0 for rec in recs), (r, recs)  # clipped: no shard moved by its norm
        for shard, holders in ((0, ("a0", "b0")), (1, ("a1", "b1"))):
            assert len({records[n][r]["checksums"][str(shard)] for n in holders}) == 1, (r, shard, recs)
    guarded = [records["a0"][r]["guard"]["loss"] for r in range(ROUNDS)]
    losses = [records["a0"][r]["val_loss"] for r in range(ROUNDS)]
    assert all(b < a for a, b in itertools.pairwise(guarded)), guarded
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    print("guard losses per round:", [round(v, 4) for v in guarded], "validation", [round(v, 4) for v in losses])
