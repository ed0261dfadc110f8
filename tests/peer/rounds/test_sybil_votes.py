"""Throwaway keys do not outvote a run's members: a peer with a valid key that publishes checksum records for a
poisoned state under ten keys that never announced or contributed (and serves that state itself) moves nobody.

Real ``hlbp join`` processes on 127.0.0.1: three honest replicas and the attacker. Only a round's members (the
senders of its accepted set) vote on its state, in the verification after each round and in every state sync.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faulty_peer import program
from round_records import by_round, wait_rounds

from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree

pytestmark = pytest.mark.slow

HONEST = ("a", "b", "c")
ROUNDS = 5


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    cfg = SimConfig(n_full=0, rounds=ROUNDS + 3, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=4.0,
                    min_deadline_s=2.0, max_deadline_s=20.0, seed=9, threads=1, run_id="sybil-test", ttl_s=10.0)
    with Swarm(cfg, tmp_path_factory.mktemp("sybil")) as sw:
        sw.start()
        wait = ("--wait-replicas", "4")
        for name in HONEST:
            sw.add(name, *wait)
        sw.add("attacker", *wait, program=program("sybil-checks:10"))
        yield sw


def test_throwaway_keys_never_move_the_members_state(swarm: Swarm) -> None:
    swarm.replicas["attacker"].proc.wait_for("sybil checksums for round 1", 120)
    wait_rounds(swarm, list(HONEST), ROUNDS)
    rounds = by_round(swarm)
    for r in range(ROUNDS):
        honest = [rounds[r][name] for name in HONEST]
        assert all(rec["in_sync"] and not rec["synced"] and rec["state_round"] is None for rec in honest), (r, honest)
        assert checksums_agree(honest), (r, honest)
    losses = [rounds[r]["a"]["val_loss"] for r in range(ROUNDS)]
    assert losses[-1] < losses[0], losses
