"""Round records pushed over the data plane carry a round without the DHT.

Three replicas start together; from round 1 on, ``quiet`` never stores its contribution notices in the DHT (a fault
hook: its stores are lost). The others can learn of its contributions only from its pushes, so its contribution
being accepted in every later round, with every peer's checksums equal, shows that pushes carry the round. With
notices in the DHT only, it would have been left out of every round from round 1 on.
"""

from __future__ import annotations

import pytest
from faulty_peer import program

from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow

NAMES = ("quiet", "a", "b")
ROUNDS = 4


def test_a_contribution_announced_only_by_push_is_accepted(tmp_path) -> None:
    cfg = SimConfig(n_full=0, rounds=ROUNDS, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=6.0,
                    min_deadline_s=3.0, max_deadline_s=12.0, seed=7, threads=1, run_id="push-test", ttl_s=60.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add("quiet", "--wait-replicas", "3", program=program("no-dht-notices:1"))
        for name in ("a", "b"):
            sw.add(name, "--wait-replicas", "3")
        poll(lambda: all(len(sw.replicas[n].rounds()) >= ROUNDS for n in NAMES), 240,
             lambda: "every replica to finish its rounds\n" + sw.replicas["quiet"].proc.output[-3000:])
        recs = {n: {rec["round"]: rec for rec in sw.replicas[n].rounds()} for n in NAMES}
    for r in range(1, ROUNDS):
        rows = [recs[n][r] for n in NAMES]
        assert all(x["members"] == 3 and x["accepted"] for x in rows), (r, rows)
        assert checksums_agree(rows), (r, rows)
