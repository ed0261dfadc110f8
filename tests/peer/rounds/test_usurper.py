"""Only the round's coordinator closes it: a peer with a valid key that publishes its own accepted set out of turn
(holding only itself, or holding nobody) is ignored, and the honest coordinator's set is the one applied.

Real ``hlbp join`` processes on 127.0.0.1: three honest replicas and one usurper, which publishes its set of every
round the moment its exchange starts. Identities are drawn so that the usurper is never the first-ranked
coordinator of the rounds checked: in its own turn a coordinator chooses the members, which this test does not
claim to prevent.
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
    """Identities under which the usurper ranks below an honest coordinator in every round checked."""
    while True:
        ids = {name: Identity.generate() for name in (*HONEST, "usurper")}
        peers = [ident.peer_id for ident in ids.values()]
        if all(coordinator_order(r, peers)[0] != ids["usurper"].peer_id for r in range(ROUNDS + 1)):
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
    for r in range(ROUNDS):
        honest = [rounds[r][name] for name in HONEST]
        # the honest coordinator's set: every honest contribution in it (and the usurper's own, which is valid)
        assert all(rec["accepted"] and rec["members"] >= 3 for rec in honest), (r, honest)
        assert checksums_agree(honest), (r, honest)
    losses = [rounds[r]["a"]["val_loss"] for r in range(ROUNDS)]
    assert losses[-1] < losses[0], losses
