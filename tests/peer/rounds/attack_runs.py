"""Attack runs: three honest replicas and one peer with a valid key, on 127.0.0.1, set beside an all-honest run
with the same identities and settings, so an attack test can state how far it moved the honest replicas.

Two yardsticks (conftest.py): the fourth peer running honestly, for an attack whose sender still contributes
honest work (a usurper, a Sybil voter); and the three honest replicas alone, for an attack whose sender's
contributions are left out (with SparseLoCo's 1/R mean, three contributors' union of top-k positions moves the
model less than four, so the run without the fourth is what a banned attacker leaves).

The identities are drawn once per test session so that the fourth peer ranks last in the turn order of every
round checked: in its own turn a coordinator chooses the members (which these tests do not claim to prevent), so
what an attack test shows is what a peer does out of turn.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from round_records import by_round, wait_rounds

from hlbp.peer.rounds.rules import coordinator_order
from hlbp.peer.sim.launcher import SimConfig, Swarm
from hlbp.protocol.identity import Identity

HONEST = ("a", "b", "c")
ATTACKER = "attacker"
ROUNDS = 4  # rounds checked
LOSS_RTOL = 0.01  # the honest replicas' final validation loss stays within 1 % of the all-honest run's


def attack_config() -> SimConfig:
    """The run every attack test and its all-honest twin share: tiny model, H = 4, windows of 8 to 20 s. A round
    closes as soon as the four announced contributions are in, so the long window costs nothing while all keep up;
    with 2 s, an honest replica a loaded box slowed was left out as a straggler, and the test failed by luck."""
    return SimConfig(n_full=0, rounds=ROUNDS + 3, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=8.0,
                     min_deadline_s=8.0, max_deadline_s=20.0, seed=5, threads=1, run_id="attack-test", ttl_s=10.0)


@cache
def identities() -> dict[str, bytes]:
    """Key files under which the attacker ranks last among the coordinators of every round checked."""
    while True:
        ids = {name: Identity.generate() for name in (*HONEST, ATTACKER)}
        peers = [ident.peer_id for ident in ids.values()]
        if all(coordinator_order(r, peers)[-1] == ids[ATTACKER].peer_id for r in range(ROUNDS + 1)):
            return {name: ident.to_file_bytes() for name, ident in ids.items()}


def start(workdir: Path, attacker_program: Sequence[str] | None = None, *attacker_flags: str,
          fourth: bool = True) -> Swarm:
    """A started swarm of the three honest replicas and the fourth peer (``attacker_program``: how it runs; None:
    as an honest replica; ``fourth`` False: the three alone). The caller closes it."""
    for name, key in identities().items():
        (workdir / f"{name}.key").write_bytes(key)
        os.chmod(workdir / f"{name}.key", 0o400)
    sw = Swarm(attack_config(), workdir)
    try:
        sw.start()
        wait = ("--wait-replicas", str(len(HONEST) + fourth))
        for name in HONEST:
            sw.add(name, *wait)
        if fourth:
            sw.add(ATTACKER, *wait, *attacker_flags, program=attacker_program)
    except BaseException:
        sw.close()
        raise
    return sw


def final_losses(swarm: Swarm) -> dict[str, float]:
    """Each honest replica's validation loss after the last round checked, once all three have recorded it."""
    wait_rounds(swarm, list(HONEST), ROUNDS)
    rounds = by_round(swarm)
    return {name: rounds[ROUNDS - 1][name]["val_loss"] for name in HONEST}


def assert_as_honest(attacked: dict[str, float], honest: dict[str, float], rounds: dict[int, dict[str, Any]]) -> None:
    """The honest replicas ended within ``LOSS_RTOL`` of the all-honest run's validation loss (printed: ``-s``
    shows the numbers the docs quote)."""
    print(f"final validation loss: attacked {attacked['a']:.4f}, yardstick {honest['a']:.4f}, ratio "
          f"{attacked['a'] / honest['a']:.4f}")
    for name in HONEST:
        assert abs(attacked[name] - honest[name]) <= LOSS_RTOL * honest[name], (
            name, attacked, honest, {r: {n: (rec["val_loss"], rec["members"]) for n, rec in recs.items()}
                                     for r, recs in rounds.items()})


def honest_rounds_agree(rounds: dict[int, dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Assert that in each round checked every honest replica's contribution was accepted, every honest replica
    ended in sync, and their checksums are equal; returns the honest records of each round, for a test's own
    checks."""
    from hlbp.peer.sim.launcher import checksums_agree

    out = []
    for r in range(ROUNDS):
        honest = [rounds[r][name] for name in HONEST]
        assert all(rec["accepted"] and rec["in_sync"] for rec in honest), (r, honest)
        assert checksums_agree(honest), (r, honest)
        out.append(honest)
    return out
