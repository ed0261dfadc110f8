"""Contribution notices that never deliver a payload get their senders banned: a peer with a valid key that
announces, with each of its contributions, 40 more under throwaway keys (the same keys every round) for payloads
that exist nowhere does not move the honest replicas, and once its keys are banned it stretches no round.

Real ``hlbp join`` processes on 127.0.0.1 (attack_runs.py); the fourth peer's own contributions are honest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from attack_runs import ATTACKER, HONEST, ROUNDS, assert_as_honest, checked_rounds, honest_rounds_agree, start
from faulty_peer import program

from hlbp.peer.sim.launcher import Swarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with start(tmp_path_factory.mktemp("fake-notices"), program("fake-notices:40")) as sw:
        yield sw


def test_notices_without_payloads_neither_stretch_rounds_nor_move_the_model(
        swarm: Swarm, honest_run: dict[int, dict[str, Any]]) -> None:
    swarm.replicas[ATTACKER].proc.wait_for("fake notices for round 0", 120)
    rounds = checked_rounds(swarm)
    for r, honest in enumerate(honest_rounds_agree(rounds)):
        # the honest three and the fourth peer's real contribution in every round, a fake never: nothing of theirs
        # could be fetched
        assert honest[0]["members"] == len(HONEST) + 1, (r, honest)
    waits = {r: max(rounds[r][n]["wait_s"] for n in HONEST) for r in range(ROUNDS)}
    print("longest close wait per round:", {r: round(w, 1) for r, w in waits.items()})
    # no round waits on them: unannounced keys neither complete a round nor rank ahead of an announced coordinator
    # (rules.complete, rules.turn_order), and they are banned at their second miss. Before that, round 0 took 30 to
    # 79 s on a loaded box and twice split the run in two
    assert max(waits.values()) <= 5.0, waits
    assert_as_honest(rounds, honest_run)
