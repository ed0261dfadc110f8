"""Only the round's coordinator closes it: a peer with a valid key that publishes its own accepted set out of turn
(holding only itself, or holding nobody) is ignored, and the honest coordinator's set is the one applied.

Real ``hlbp join`` processes on 127.0.0.1: three honest replicas and one usurper, which publishes its set of every
round the moment its exchange starts. Identities are drawn so that the usurper ranks last among the coordinators of
the rounds checked: in its own turn a coordinator chooses the members, which this test does not claim to prevent,
and a takeover is its turn too once every better-ranked coordinator has let its delay pass (on a loaded box a slow
coordinator can, so one such round is tolerated; without the rule the usurper's set took every round at once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty_peer import program
from round_records import by_round, wait_rounds

from hlbp.peer.rounds.rules import coordinator_order
from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow

HONEST = ("a", "b", "c")
ROUNDS = 4  # rounds checked


def _identities() -> dict[str, Identity]:
    """Identities under which the usurper ranks last among the coordinators of every round checked."""
    while True:
        ids = {name: Identity.generate() for name in (*HONEST, "usurper")}
        peers = [ident.peer_id for ident in ids.values()]
        if all(coordinator_order(r, peers)[-1] == ids["usurper"].peer_id for r in range(ROUNDS + 1)):
            return ids


@pytest.fixture(scope="module", params=["own-set", "empty-set"])
def swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    workdir: Path = tmp_path_factory.mktemp("usurper")
    for name, ident in _identities().items():
        (workdir / f"{name}.key").write_bytes(ident.to_file_bytes())
        os.chmod(workdir / f"{name}.key", 0o400)
    cfg = SimConfig(n_full=0, rounds=ROUNDS + 3, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=4.0,
                    min_deadline_s=2.0, max_deadline_s=20.0, seed=5, threads=1, run_id="usurper-test", ttl_s=10.0)
    fault = "usurper:empty" if request.param == "empty-set" else "usurper"
    with Swarm(cfg, workdir) as sw:
        sw.start()
        wait = ("--wait-replicas", "4")
        for name in HONEST:
            sw.add(name, *wait)
        sw.add("usurper", *wait, program=program(fault))
        yield sw


def test_a_set_published_out_of_turn_is_never_applied(swarm: Swarm) -> None:
    usurper = swarm.replicas["usurper"]
    usurper.proc.wait_for("usurping round 0", 120)
    wait_rounds(swarm, list(HONEST), ROUNDS)
    rounds = by_round(swarm)
    # a round the honest coordinator closed: the honest contributions in its set (and the usurper's own, valid);
    # the usurper's sets hold no honest contribution at all
    honest_rounds = [r for r in range(ROUNDS)
                     if sum(rounds[r][name]["accepted"] for name in HONEST) >= 2 and rounds[r]["a"]["members"] >= 3]
    assert len(honest_rounds) >= ROUNDS - 1, {r: [rounds[r][n] for n in HONEST] for r in range(ROUNDS)}
    for r in range(ROUNDS):
        in_sync = [rounds[r][name] for name in HONEST if rounds[r][name]["in_sync"]]
        assert len(in_sync) >= 2 and checksums_agree(in_sync), (r, [rounds[r][n] for n in HONEST])
    losses = [rounds[r]["a"]["val_loss"] for r in range(ROUNDS)]
    assert losses[-1] < losses[0], losses
