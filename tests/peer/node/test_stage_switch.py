"""A slow stage peer that came first is a standby again once a faster one is there, as real ``hlbp join`` processes on
loopback.

A full replica and a 2-stage swarm share the rounds; stage 1 has two peers. The first announces five times the
other's throughput and is picked first, but it computes slowly (``hlbp.cli.slowstage``: each training pass
takes 16 times as long). What must hold: once the driver has measured it, the first step of a later phase goes through the faster
peer, with no failure and no ban; the swarm's steps get faster; the new peer's work is accepted, shard 1's checksum
is the same on it, the slow peer and the full replica; and the slow peer stays alive and current.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

import pytest
from stage_runs import round_record, stage_peer_id

from hlbp.cli.slowstage import program
from hlbp.peer.sim.launcher import SimConfig, Swarm

pytestmark = pytest.mark.slow

H = 4
SLOW = 16.0  # how many times as long the slow peer takes over each training pass (and how much less it announces)


def test_a_stage_goes_to_a_faster_peer_at_a_phase_start(tmp_path: Path) -> None:
    cfg = SimConfig(n_stages=2, inner_steps=H, batch_size=4, seq_len=64, seed=5, run_id="switch", ttl_s=8.0,
                    micro_batches=2, max_peers_per_stage=2)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        # the slow peer claims 5000 tokens/s (the last --throughput wins, divided by SLOW as a slow probe would
        # measure), the fast one the launcher's 1000
        slow = sw.add_stage("slow", 1, "--throughput", f"{5000 * SLOW:g}", program=program(SLOW))
        slow.proc.wait_for("^announced", 60)
        fast = sw.add_stage("fast", 1)
        fast.proc.wait_for("^announced", 60)
        full = sw.add("peer0", "--wait-replicas", "3", rounds=1000)
        driver = sw.add_stage("sw0s0", 0, "--micro-batches", "2", "--eval-every", "0", "--switch-factor", "2")
        slow_id, fast_id = stage_peer_id(slow), stage_peer_id(fast)

        def steps() -> list[dict[str, Any]]:
            return [s for s in driver.events("step") if "chain" in s]

        switched = sw.wait(lambda: next((s for s in steps() if s["chain"] == [fast_id]), None),
                           "a step of the driver through the faster peer")
        last = switched["round"] + 2
        sw.wait(lambda: all(round_record(p.rounds(), last) for p in (full, fast, slow, driver)),
                f"round {last} on every peer")
        done = steps()
        output = driver.proc.output
        alive = {n: r.proc.alive for n, r in sw.replicas.items()}
        fulls, fasts, slows, drives = (p.rounds() for p in (full, fast, slow, driver))

    assert all(alive.values()), alive
    before = [s for s in done if s["step"] < switched["step"]]
    after = [s for s in done if s["step"] >= switched["step"]]
    # the claimed rate put the slow peer first; it served until the switch, the faster peer from then on
    assert before and all(s["chain"] == [slow_id] for s in before), before
    assert all(s["chain"] == [fast_id] for s in after), after
    # at a phase's first step (a standby holds the round's result), not mid-phase
    assert not any(s["round"] == switched["round"] for s in before), (before[-1], switched)
    assert switched["round"] > 0, switched  # the slow peer was measured first
    # no failure: the slow peer was neither failed nor banned, and the driver said why it switched
    assert "failed; banned" not in output and "takes over from" in output, output[-3000:]
    # the swarm's steps got faster
    assert median(s["seconds"] for s in after) * 1.5 < median(s["seconds"] for s in before), (before, after)
    for r in range(switched["round"], last + 1):
        f, a, b, d = round_record(fulls, r), round_record(fasts, r), round_record(slows, r), round_record(drives, r)
        assert f is not None and a is not None and b is not None and d is not None, r
        # every holder of shard 1, the standby included, ends every round with the same checksum of it
        assert a["checksums"]["1"] == f["checksums"]["1"] == b["checksums"]["1"], (r, f, a, b)
        assert all(x["in_sync"] for x in (f, a, b, d)), (r, f, a, b, d)
        # the new peer's work is taken; the slow peer, a standby again, contributes nothing new
        assert a["accepted"] and d["accepted"], (r, a, d)
