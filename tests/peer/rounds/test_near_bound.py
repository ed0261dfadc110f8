"""A contribution just under the norm bound does not poison the run: a peer with a valid key that sends every
contribution sign-flipped at 7.9x its shard's parameter norm (the guard refuses above 8x) is left out as far above
the round's other contributions, banned, and the honest replicas end where the three of them end alone.

Real ``hlbp join`` processes on 127.0.0.1 (attack_runs.py). Before the median rule the same attack, 6x and
sign-flipped, took a live run's validation loss from 8.1 to 125,723 in 12 rounds, every step under the loss guard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from attack_runs import (
    ATTACKER,
    HONEST,
    assert_as_honest,
    checked_rounds,
    honest_rounds_agree,
    identities,
    start,
)
from faulty_peer import program

from hlbp.peer.sim.launcher import Swarm
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with start(tmp_path_factory.mktemp("near-bound"), program("near-bound:7.9")) as sw:
        yield sw


def test_a_contribution_just_under_the_bound_is_left_out_and_its_sender_banned(
        swarm: Swarm, three_honest_run: dict[int, dict[str, Any]]) -> None:
    swarm.replicas[ATTACKER].proc.wait_for("near-bound contribution to round 0", 120)
    rounds = checked_rounds(swarm)
    attacker_id = Identity.from_file_bytes(identities()[ATTACKER]).peer_id
    for r, honest in enumerate(honest_rounds_agree(rounds)):
        assert honest[0]["members"] == len(HONEST), (r, honest)  # the poison is in no round's result
    assert attacker_id in rounds[0]["a"]["banned"], rounds[0]["a"]
    assert_as_honest(rounds, three_honest_run)  # the attack moved nothing beyond its absence
