"""A member that dies after its contribution was accepted does not hold the survivors for the checksum window.

Three replicas start together; ``gone`` applies round 1 (its contribution accepted), stalls, and SIGKILLs itself
before it publishes its checksums, its announcement still online. The two survivors agree and outvote whatever
it could still publish, so their verification ends at once instead of after ``checks_wait_s`` (10 s).
"""

from __future__ import annotations

import pytest
from faulty_peer import program

from hlbp.peer.rounds.loop import RoundConfig
from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow

DIES_IN = 1
CHECKS_WAIT_S = RoundConfig(run_id="x", inner_steps=1).checks_wait_s


def test_survivors_verify_without_waiting_for_a_dead_member(tmp_path) -> None:
    # a generous window: on 2 busy cores all three must make round 1's window for gone to be a member
    cfg = SimConfig(n_full=0, rounds=3, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=6.0,
                    min_deadline_s=6.0, max_deadline_s=12.0, seed=5, threads=1, run_id="verify-test", ttl_s=60.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add("gone", "--wait-replicas", "3", program=program(f"die-after-apply:{DIES_IN}"))
        for name in ("a", "b"):
            sw.add(name, "--wait-replicas", "3")
        gone = sw.replicas["gone"].proc
        poll(lambda: not gone.alive, 240, lambda: f"gone to die in round {DIES_IN}\n{gone.output[-3000:]}")
        assert gone.find(rf"dying after applying round {DIES_IN}"), gone.output[-3000:]
        recs = {}

        def survivors_done() -> bool:
            recs.update({n: {rec["round"]: rec for rec in sw.replicas[n].rounds()} for n in ("a", "b")})
            return all(DIES_IN + 1 in recs[n] for n in ("a", "b"))

        poll(survivors_done, 240, lambda: "a and b to finish the round after gone's death\n"
             + "\n".join(sw.replicas[n].proc.output[-2000:] for n in ("a", "b")))
        pair = [recs["a"][DIES_IN], recs["b"][DIES_IN]]
        assert all(rec["in_sync"] and rec["accepted"] and rec["members"] == 3 for rec in pair), pair
        assert checksums_agree(pair)
        # gone's record stays online for ttl_s: only the decided majority can have ended the wait this early
        assert max(rec["phases"]["verify"] for rec in pair) < CHECKS_WAIT_S / 3, [rec["phases"] for rec in pair]
        after = [recs["a"][DIES_IN + 1], recs["b"][DIES_IN + 1]]
        assert all(rec["in_sync"] for rec in after) and checksums_agree(after), after
