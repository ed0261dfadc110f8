"""A coordinator stopped as it closed a round, before its accepted set reached anybody, comes back in sync.

Three full replicas, real ``hlbp join`` processes on 127.0.0.1. Identities are drawn so that c ranks first in round
``ROUND``; c (``stopped_coordinator.py``) closes that round on its own contribution with a set nobody else ever
sees, applies it, saves its checkpoint without proof of the set and exits on its own SIGTERM. a and b wait out the
window and a takeover (21 s in this run: its manifest has two stages) and close the round with their own set, whose
result differs from the one in c's checkpoint.

c restarts at once, well inside that takeover. Its checkpoint is one round past the newest state the members
agreed on, and the members are still closing that round: it must wait for their result and sync it, not resume
its own and run the next rounds alone (which it did: one-member rounds, a round ahead of a and b).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from round_records import ROUND_TIMEOUT_S, by_round, rounds_config, write_keys
from stopped_coordinator import program

from hlbp.peer.rounds.rules import coordinator_order
from hlbp.peer.sim.launcher import Swarm, checksums_agree, poll
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow

ROUND = 2
NAMES = ("a", "b", "c")


def _identities() -> dict[str, Identity]:
    """a, b and c such that c coordinates round ``ROUND`` first when all three were members of the round before."""
    while True:
        ids = {name: Identity.generate() for name in NAMES}
        if coordinator_order(ROUND, [i.peer_id for i in ids.values()])[0] == ids["c"].peer_id:
            return ids


def test_a_coordinator_stopped_before_its_set_got_out_syncs_the_others_result(tmp_path: Path) -> None:
    write_keys(tmp_path, _identities())
    with Swarm(rounds_config(), tmp_path) as sw:
        sw.start()
        wait = ("--wait-replicas", str(len(NAMES)))
        a, _b = sw.add("a", *wait), sw.add("b", *wait)
        c = sw.add("c", *wait, program=program(ROUND))
        poll(lambda: not c.proc.alive, ROUND_TIMEOUT_S, lambda: f"c to stop after its secret round\n{c.proc.output[-3000:]}")
        assert c.proc.popen.returncode == 0, c.proc.output[-3000:]
        found = c.proc.find(r"^stopping after applying round (\d+)")
        assert found, c.proc.output[-3000:]
        secret = int(found[0].group(1))
        own = next((x for x in c.rounds() if x["round"] == secret), None)  # c's record of its own result, if written
        back = sw.add("c")
        start = back.proc.wait_for(r"^replica: (.*); starting at round (\d+)", ROUND_TIMEOUT_S)
        # c syncs the others' state: of the secret round when it came back while they were still closing it, of a
        # later one when a loaded box restarted it after they had gone on (it must never resume its own)
        synced = re.fullmatch(r"synced round (\d+) from peers", start.group(1))
        assert synced and int(synced.group(1)) >= secret, start.group(0)
        first = int(start.group(2))
        # the two rounds from c's return, as each of the three recorded them
        poll(lambda: all(any(x["round"] >= first + 1 for x in sw.replicas[n].rounds()) for n in NAMES),
             ROUND_TIMEOUT_S, lambda: f"every replica to finish round {first + 1}\n--- c\n{back.proc.output[-3000:]}"
                                      f"\n--- a\n{a.proc.output[-3000:]}")
        rounds = by_round(sw)
        logs = "\n".join(f"--- {n}\n{sw.replicas[n].proc.output[-2500:]}" for n in NAMES)

    # the others' result of the secret round is not the one c applied (else the test shows nothing)
    assert own is None or own["checksums"] != rounds[secret]["a"]["checksums"], (own, rounds[secret]["a"])
    for r in (first, first + 1):
        rows = rounds[r]
        assert set(rows) == set(NAMES), (r, sorted(rows), logs)
        # in a and b's rounds, not alone: c may sit out the first while it syncs, or straggle behind once
        assert all(x["in_sync"] and x["members"] >= 2 for x in rows.values()), (r, rows, logs)
        assert checksums_agree(list(rows.values())), (r, rows)
