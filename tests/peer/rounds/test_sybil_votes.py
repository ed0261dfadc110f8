"""Throwaway keys do not outvote a run's members: a peer with a valid key that publishes checksum records for a
poisoned state under ten keys that never announced or contributed (and serves that state itself) moves nobody.

Real ``hlbp join`` processes on 127.0.0.1 (attack_runs.py): three honest replicas and the attacker, whose
contributions are honest. Only a round's members (the senders of its accepted set) vote on its state, in the
verification after each round and in every state sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from attack_runs import ATTACKER, HONEST, ROUNDS, assert_as_honest, checked_rounds, start
from faulty_peer import program

from hlbp.peer.sim.launcher import Swarm, checksums_agree

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with start(tmp_path_factory.mktemp("sybil"), program("sybil-checks:10")) as sw:
        yield sw


def test_throwaway_keys_never_move_the_members_state(swarm: Swarm, honest_run: dict[int, dict[str, Any]]) -> None:
    swarm.replicas[ATTACKER].proc.wait_for("sybil checksums for round 1", 120)
    rounds = checked_rounds(swarm)
    for r in range(ROUNDS):
        honest = [rounds[r][name] for name in HONEST]
        assert all(rec["in_sync"] and not rec["synced"] and rec["state_round"] is None for rec in honest), (r, honest)
        assert checksums_agree(honest), (r, honest)
    assert_as_honest(rounds, honest_run)
