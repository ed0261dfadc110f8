"""A restart that finds the swarm where it left it resumes from its own checkpoint instead of syncing.

Two replicas run two rounds and leave on their own (``--rounds 2``: exit 0, checkpoint saved). Nobody trains
while they are gone, so when both come back each finds its checkpoint current: the others' latest published
checksums are for the round its checkpoint holds. They resume without downloading any state and go on in sync.
"""

from __future__ import annotations

import pytest

from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow

TIMEOUT_S = 150.0  # a bound on a few rounds on 2 busy cores, not an expected duration


def test_restart_with_a_current_checkpoint_resumes_without_sync(tmp_path) -> None:
    cfg = SimConfig(n_full=0, rounds=2, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=3.0,
                    min_deadline_s=1.0, max_deadline_s=10.0, seed=5, threads=1, run_id="resume-test", ttl_s=10.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        for name in ("a", "b"):
            sw.add(name)
        for name in ("a", "b"):
            proc = sw.replicas[name].proc
            poll(lambda p=proc: not p.alive, TIMEOUT_S,
                 lambda p=proc, name=name: f"{name} to finish 2 rounds and leave\n{p.output[-3000:]}")
            assert proc.popen.returncode == 0, proc.output[-3000:]
        first = {name: sw.replicas[name].rounds() for name in ("a", "b")}
        assert checksums_agree([first["a"][-1], first["b"][-1]])
        for name in ("a", "b"):
            sw.add(name, rounds=1)
        for name in ("a", "b"):
            again = sw.replicas[name]
            line = again.proc.wait_for(r"^replica: (.*); starting at round (\d+)", TIMEOUT_S)
            assert line.group(1) == "resumed from checkpoint (current)", line.group(0)
            assert int(line.group(2)) == 2
            poll(lambda r=again: len(r.rounds()) > 2, TIMEOUT_S, f"{name} to finish its round after the restart")
        last = {name: sw.replicas[name].rounds()[-1] for name in ("a", "b")}
        assert all(rec["round"] == 2 and rec["accepted"] and rec["in_sync"] for rec in last.values()), last
        assert checksums_agree(list(last.values()))
        assert not any(rec["synced"] for name in ("a", "b") for rec in sw.replicas[name].rounds())
