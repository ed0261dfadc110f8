"""A run with a capped gather set, with real ``hlbp join`` processes on 127.0.0.1: four replicas, F = 2.

The identities are drawn so that the breaker (a coordinator that accepts every contribution, over the cap) ranks
first in round 0. Every honest replica refuses its set and bans it, the next coordinator in turn closes round 0
with two members, and from then on every round takes two, the replicas rotate through the set (each left out at
times and accepted again), and every honest checksum agrees. A
replica stopped and restarted comes back with a cold standing when it missed rounds (it checks only the cap and
takes its coordinator's turn last), or with its checkpoint's standing and bans when it resumes the current round;
either way it is accepted again within a few rounds with the others' checksums.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty_peer import program
from round_records import by_round, wait_rounds, write_keys

from hlbp.peer.rounds.rules import coordinator_order
from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow

HONEST = ("a", "b", "c")
BREAKER = "breaker"
GATHER = 2
ROUNDS = 6  # rounds checked


def _identities() -> dict[str, Identity]:
    """Keys under which the breaker coordinates round 0."""
    while True:
        ids = {name: Identity.generate() for name in (*HONEST, BREAKER)}
        if coordinator_order(0, [i.peer_id for i in ids.values()])[0] == ids[BREAKER].peer_id:
            return ids


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, str]]]:
    ids = _identities()
    workdir: Path = tmp_path_factory.mktemp("gather")
    peer = write_keys(workdir, ids)
    cfg = SimConfig(n_full=0, rounds=ROUNDS + 12, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=8.0,
                    min_deadline_s=8.0, max_deadline_s=20.0, seed=11, threads=1, run_id="gather-test", ttl_s=10.0,
                    gather=GATHER, reserves=1)
    with Swarm(cfg, workdir) as sw:
        sw.start()
        wait = ("--wait-replicas", str(len(ids)))
        for name in HONEST:
            sw.add(name, *wait)
        sw.add(BREAKER, *wait, program=program("gather-breaker"))
        yield sw, peer


def test_a_coordinator_over_the_cap_is_refused_and_banned(swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, peer = swarm
    rounds = wait_rounds(sw, list(HONEST), 2)
    first = [rounds[0][x] for x in HONEST]
    assert all(rec["members"] == GATHER for rec in first), first
    assert checksums_agree(first)
    assert all(peer[BREAKER] in rec["banned"] for rec in first), first
    for name in HONEST:
        sw.replicas[name].proc.wait_for(f"{peer[BREAKER][:16]} .*breaks the gather rule", 60)


def test_every_round_takes_f_and_the_replicas_rotate(swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, _peer = swarm
    rounds = wait_rounds(sw, list(HONEST), ROUNDS)
    taken: dict[str, list[int]] = {x: [] for x in HONEST}
    for r in range(ROUNDS):
        recs = [rounds[r][x] for x in HONEST]
        assert all(rec["members"] <= GATHER and rec["in_sync"] for rec in recs), (r, recs)
        assert checksums_agree(recs), (r, recs)
        for x in HONEST:
            if rounds[r][x]["accepted"]:
                taken[x].append(r)
    # three honest replicas share two places (the breaker is banned for a while): each is left out at times and
    # accepted again
    assert all(2 <= len(t) < ROUNDS for t in taken.values()), taken


def test_a_restarted_replica_is_taken_back_under_the_cap(swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, _peer = swarm
    wait_rounds(sw, list(HONEST), 2)
    c = sw.replicas["c"]
    assert c.proc.stop(timeout=30) == 0, c.proc.output[-2000:]
    before = len(c.rounds())
    again = sw.add("c")
    again.proc.wait_for(r"^replica: (.*); starting at round (\d+)", 120)
    within = 5  # three replicas and two places: a due veteran gets one within two rounds; slack for 2 busy cores
    poll(lambda: any(rec["accepted"] for rec in again.rounds()[before:before + within])
         or len(again.rounds()) >= before + within, 240, "c's first rounds after its restart")
    assert any(rec["accepted"] for rec in again.rounds()[before:before + within]), again.proc.output[-4000:]
    rounds = by_round(sw)
    last = max(r for r, recs in rounds.items() if set(HONEST) <= set(recs))
    assert checksums_agree([rounds[last][x] for x in HONEST]), rounds[last]
