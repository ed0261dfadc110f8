"""Only the round's coordinator closes it: a peer with a valid key that publishes its own accepted set out of turn,
holding only itself (and banning everybody else) or holding nobody, is ignored; the coordinator in charge closes
every round, nobody honours the usurper's bans, and the honest replicas end where an all-honest run ends.

Real ``hlbp join`` processes on 127.0.0.1 (attack_runs.py): three honest replicas and the usurper, which publishes
its set of every round the moment its exchange starts. The turn order starts with the previous round's members,
agreed before the round opens, so announcing first buys no turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from attack_runs import ATTACKER, HONEST, ROUNDS, assert_as_honest, checked_rounds, identities, start
from faulty_peer import program

from hlbp.peer.sim.launcher import Swarm, checksums_agree
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["own-set", "empty-set"])
def swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    fault = "usurper:empty" if request.param == "empty-set" else "usurper"
    with start(tmp_path_factory.mktemp("usurper"), program(fault)) as sw:
        yield sw


def test_a_set_published_out_of_turn_is_never_applied(swarm: Swarm, honest_run: dict[int, dict[str, Any]]) -> None:
    swarm.replicas[ATTACKER].proc.wait_for("usurping round 0", 120)
    rounds = checked_rounds(swarm)
    honest_ids = {Identity.from_file_bytes(key).peer_id for name, key in identities().items() if name in HONEST}
    for r in range(ROUNDS):
        honest = [rounds[r][name] for name in HONEST]
        # every round closed by an honest coordinator: all three honest contributions in it, none banned
        assert all(rec["accepted"] and rec["in_sync"] and rec["members"] >= 3 for rec in honest), (r, honest)
        assert checksums_agree(honest), (r, honest)
        assert not set(rounds[r]["a"]["banned"]) & honest_ids, (r, honest)  # the usurper's bans were not taken
    assert_as_honest(rounds, honest_run)
