"""The manifest's minimum number of contributors: two replicas in a run that requires three.

Every round waits up to the longest window for a third contributor, then closes empty: nobody's parameters move,
every replica still ends the round with the same checksums, and nobody waits forever.
"""

from __future__ import annotations

import pytest

from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow


def test_too_few_contributors_close_the_round_empty(tmp_path) -> None:
    cfg = SimConfig(n_full=0, rounds=2, inner_steps=3, batch_size=4, seq_len=64, round_deadline_s=1.0,
                    min_deadline_s=1.0, max_deadline_s=3.0, seed=11, threads=1, run_id="min-test", ttl_s=10.0,
                    min_contributors=3)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        for name in ("a", "b"):
            sw.add(name)
        for name in ("a", "b"):
            proc = sw.replicas[name].proc
            poll(lambda p=proc: not p.alive, 150,
                 lambda p=proc, name=name: f"{name} to finish its rounds\n{p.output[-3000:]}")
            assert proc.popen.returncode == 0, proc.output[-3000:]
        recs = {name: sw.replicas[name].rounds() for name in ("a", "b")}
        for r in range(2):
            pair = [recs["a"][r], recs["b"][r]]
            assert all(rec["contributed"] and not rec["accepted"] and rec["members"] == 0 for rec in pair), pair
            assert checksums_agree(pair)
        assert recs["a"][0]["checksums"] == recs["a"][1]["checksums"]  # the parameters did not move
        assert any(p.find(r"closing it empty") for p in (sw.replicas["a"].proc, sw.replicas["b"].proc))
