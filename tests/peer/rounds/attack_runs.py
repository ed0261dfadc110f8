"""Attack runs: three honest replicas and one peer with a valid key, on 127.0.0.1, set beside an all-honest twin
run with the same identities and settings, so an attack test can show that it moved the honest replicas not at all.

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


def attack_config() -> SimConfig:
    """The run every attack test and its all-honest twin share: tiny model, H = 4, windows of 8 to 20 s, each round
    in turn (overlap "none").

    A round closes as soon as the four announced contributions are in, so the long window costs nothing while all
    keep up; with 2 s, an honest replica a loaded box slowed was left out as a straggler, and the test failed by luck.
    Rounds in turn make a run deterministic: the same contributions accepted onto the same state give the same bytes,
    so an attacked run is compared with its twin exactly. Under eager overlap where the result lands in the next
    phase depends on timing: with the same four members every round, a loaded flood run ended 0.7 % from its twin."""
    return SimConfig(n_full=0, rounds=ROUNDS + 3, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=8.0,
                     min_deadline_s=8.0, max_deadline_s=20.0, seed=5, threads=1, run_id="attack-test", ttl_s=10.0,
                     overlap="none")


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


def checked_rounds(swarm: Swarm) -> dict[int, dict[str, dict[str, Any]]]:
    """Every replica's round records by round, once each honest replica has recorded every round checked."""
    wait_rounds(swarm, list(HONEST), ROUNDS)
    return by_round(swarm)


def assert_as_honest(attacked: dict[int, dict[str, Any]], twin: dict[int, dict[str, Any]]) -> None:
    """Each honest replica ended every round checked exactly as in the twin run: as many members accepted, its own
    contribution accepted alike, the same checksums and validation loss (printed for the last round: ``-s`` shows
    the number the docs quote). Equal members are the premise: a replica left out as a straggler would make the runs
    differ by its absence, not by the attack."""
    print(f"final validation loss: attacked {attacked[ROUNDS - 1]['a']['val_loss']:.4f}, "
          f"twin {twin[ROUNDS - 1]['a']['val_loss']:.4f}")
    for r in range(ROUNDS):
        for name in HONEST:
            got, want = attacked[r][name], twin[r][name]
            assert (got["members"], got["accepted"]) == (want["members"], want["accepted"]), (r, name, got, want)
            assert (got["checksums"], got["val_loss"]) == (want["checksums"], want["val_loss"]), (r, name, got, want)


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
