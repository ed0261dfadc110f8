"""Churn in a run of real ``hlbp join`` processes on 127.0.0.1: a peer joins mid-run, one is SIGKILLed mid-round,
one is stopped with SIGTERM, and both come back with their identity and out-dir.

Three honest replicas (a, b, c) start together. Each test brings about the churn it checks itself (a joiner is
added by its fixture once the run is under way; the restart test stops and kills the peers it restarts), so each
runs alone or in any order on the module's swarm.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from round_records import (
    CLOSE_SLACK_S,
    MAX_DEADLINE_S,
    OVERLAP,
    ROUND_TIMEOUT_S,
    TAKEOVER_S,
    by_round,
    rounds_as_of,
    rounds_config,
    state_round,
    wait_rounds,
)

from hlbp.peer.sim.launcher import Replica, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with Swarm(rounds_config(), tmp_path_factory.mktemp("swarm")) as sw:
        sw.start()
        for name in ("a", "b", "c"):
            sw.add(name)
        yield sw


@pytest.fixture(scope="module")
def joiner(swarm: Swarm) -> Replica:
    """A replica that joins once the run is under way (a has finished a round): it syncs while the others go on."""
    wait_rounds(swarm, ["a"], 1)
    return swarm.add("late")


def test_sigkill_mid_round_survivors_complete_and_agree(swarm: Swarm) -> None:
    c = swarm.replicas["c"]
    done = len(c.rounds())
    # two rounds: the one under way when they died may have waited for a takeover of its coordinator
    poll(lambda: len(c.rounds()) > done + 1, ROUND_TIMEOUT_S, "c to finish two more rounds")
    # c is now in this round's inner phase; under overlap it has already announced this round (a record is written
    # when its exchange is joined, after the next contribution), so it dies after its payload may have been
    # accepted: the survivors then fetch it from the coordinator, which checked it before accepting it
    killed_in = c.rounds()[-1]["round"] + 1
    c.proc.kill()
    rounds = {}

    def survivors_done() -> bool:
        nonlocal rounds
        rounds = by_round(swarm)
        return all(n in rounds.get(killed_in + 1, {}) for n in ("a", "b"))

    poll(survivors_done, ROUND_TIMEOUT_S, f"a and b to finish rounds {killed_in} and {killed_in + 1} without c")
    # a survivor that could not fetch an accepted payload of c's resyncs in that round and records the state it
    # loaded (state_round, a later round's): compared with a's record of that round
    rounds = rounds_as_of(swarm, [rounds[r][n] for r in (killed_in, killed_in + 1) for n in ("a", "b")])
    for r in (killed_in, killed_in + 1):
        a, b = rounds[r]["a"], rounds[r]["b"]
        for rec in (a, b):
            assert rec["in_sync"] and rec["checksums"] == rounds[state_round(rec)]["a"]["checksums"], \
                (r, rec["state_round"], rec["synced"], rec["in_sync"], rec["checksums"], rounds[state_round(rec)]["a"])
        assert a["accepted"] and b["accepted"], (r, a, b)
        # closed by the deadline, not by waiting for c: at most the longest window and one takeover (under overlap
        # c may have announced the round it died in and be first in its turn order: the next-ranked coordinator
        # then takes over, 19 s seen in a loaded suite run). The close alone is bounded: what the exchange takes
        # after it (fetching, applying, verifying) is the box's load, not c's absence
        for rec in (a, b):
            assert rec["phases"]["close"] <= MAX_DEADLINE_S + TAKEOVER_S + CLOSE_SLACK_S, \
                (r, rec["wait_s"], rec["phases"])
    assert not c.proc.alive


def test_joiner_syncs_and_contributes(swarm: Swarm, joiner: Replica) -> None:
    late = joiner
    line = late.proc.wait_for(r"^replica: (.*); starting at round (\d+)", ROUND_TIMEOUT_S)
    assert line.group(1).startswith("synced round"), line.group(0)
    wait_rounds(swarm, ["late"], 2)
    first = swarm.replicas["late"].rounds()[:2]
    assert any(rec["accepted"] for rec in first), first
    recs = rounds_as_of(swarm, first)
    for rec in first:
        assert rec["in_sync"] and rec["checksums"] == recs[state_round(rec)]["a"]["checksums"], rec


# Rounds within which a restarted peer is accepted again, counting the round it sits out after a state sync.
# Without overlap: that round and the next. Under overlap the next is a catch-up phase (rounds/loop.py) that ends
# once others announce its round, and on 8 processes sharing 2 cores its notice can still miss the 2 s window (its
# first step ran 1.4-1.6 s beside the background apply of the round it sat out). Since a synced peer pushes its
# checksums (and so hears of the next notices by push), 10 restarts of 10 were accepted in that round (3 of 10
# before). On a slower day of the same box (the whole suite 30 % slower) a restart missed the window in its
# catch-up round and again in the next, cut short to 4 of 6 steps, then went on (2 fresh-clone failures in about
# 10 runs, both under eager, none logged a fetch failure: the notice came after the close; a third in CI missed 5
# rounds in a row beside the faulty peers, which now run in another test module). The bound keeps three rounds of
# slack: what it checks is that a restarted peer is taken back, not how fast on 2 shared cores.
WITHIN = 2 if OVERLAP == "none" else 5


def test_restarted_peers_resume_or_sync_and_are_accepted_again(swarm: Swarm) -> None:
    wait_rounds(swarm, ["a", "b", "c"], 1)  # both have a checkpoint or a state to come back to
    b = swarm.replicas["b"]
    assert b.proc.stop(timeout=30) == 0, b.proc.output[-2000:]
    assert b.proc.find("leaving: marking this peer offline")
    swarm.replicas["c"].proc.kill()  # no-op if the SIGKILL test already did
    before = {name: len(swarm.replicas[name].rounds()) for name in ("b", "c")}
    for name in ("b", "c"):  # b stopped cleanly, c SIGKILLed; both come back at once
        swarm.add(name)
    started = []
    for name in ("b", "c"):
        again = swarm.replicas[name]
        line = again.proc.wait_for(r"^replica: (.*); starting at round (\d+)", ROUND_TIMEOUT_S)
        assert line.group(1).startswith(("resumed", "synced")), line.group(0)
        started.append(int(line.group(2)))
        n = before[name]
        # done at its first accepted round, or after WITHIN rounds without one
        poll(lambda r=again, n=n: len(r.rounds()) >= n + WITHIN
             or any(rec["accepted"] for rec in r.rounds()[n:n + WITHIN]), ROUND_TIMEOUT_S,
             f"{name}'s first {WITHIN} rounds after its restart")
        first = again.rounds()[n:n + WITHIN]
        assert any(rec["accepted"] for rec in first), (
            f"{name} not accepted within {WITHIN} rounds of its restart:\n"
            + "\n".join(json.dumps(rec, default=str) for rec in first)
            + f"\n--- {name}'s log\n{again.proc.output[-6000:]}")
    # The three agree again within a few rounds of the comeback. A peer that came back may first take another
    # coordinator's set than the others did (its window is not the others' yet): the checksums show the split and
    # the minority resyncs, which is what this waits for; a split that lasts fails it.
    first, settle = max(started), WITHIN + 2

    def agreed() -> list[int]:
        rounds = by_round(swarm)
        return [r for r, recs in rounds.items() if first <= r <= first + settle and {"a", "b", "c"} <= set(recs)
                and checksums_agree([recs[n] for n in ("a", "b", "c")])]

    poll(lambda: agreed() or all(len(swarm.replicas[n].rounds()) and swarm.replicas[n].rounds()[-1]["round"]
                                 > first + settle for n in ("a", "b", "c")),
         ROUND_TIMEOUT_S * (settle + 1), f"a, b and c agreeing within {settle} rounds of round {first}")
    assert agreed(), {r: {n: (rec["checksums"], rec["accepted"], rec["in_sync"]) for n, rec in recs.items()}
                      for r, recs in by_round(swarm).items() if r >= first}
