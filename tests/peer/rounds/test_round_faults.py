"""The round protocol's rules, checked on one swarm of real ``hlbp join`` processes on 127.0.0.1.

One swarm serves every test, to fit a small machine: three honest replicas (a, b, c), two lying ones (liar, serving
corrupt payloads, and fat, announcing payloads above the size limit) and a straggler (slow, sleeping after every
inner step) start together; a joiner arrives mid-run; the faulty three leave once their tests are done; then c is
SIGKILLed mid-round, b is stopped with SIGTERM, and both come back with their identity and out-dir. The tests run in
file order and each waits, with a deadline, for the rounds it inspects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from faulty_peer import program

from hlbp.peer.sim.launcher import Replica, SimConfig, Swarm, checksums_agree, poll
from hlbp.protocol.records import Hyperparameters

pytestmark = pytest.mark.slow

INNER_STEPS = 6
DELAY_S = 4.0  # the straggler's sleep per inner step: 24 s of inner phase against the honest peers' few seconds
MAX_DEADLINE_S = 10.0  # the manifest's longest collection window
# the shortest: 8 processes share 2 cores here, so equal work finishes up to a second apart, and the window must
# absorb that jitter or honest peers become stragglers (the straggler itself is about 20 s behind)
MIN_DEADLINE_S = 2.0
TAKEOVER_S = 3.0  # RoundConfig.takeover_s: how long each further-ranked coordinator waits past the window
ROUND_TIMEOUT_S = 120.0  # a bound on waiting for a few rounds on 2 busy cores, not an expected duration
# the run's overlap mode: CI runs the default (eager, Hyperparameters.DEFAULT_OVERLAP); HLBP_TEST_OVERLAP=none runs
# every fault with each round in turn (the suite's 15-minute budget has no room for both)
OVERLAP = os.environ.get("HLBP_TEST_OVERLAP") or Hyperparameters.DEFAULT_OVERLAP["sparseloco"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    cfg = SimConfig(n_full=0, rounds=40, inner_steps=INNER_STEPS, batch_size=4, seq_len=64, round_deadline_s=4.0,
                    min_deadline_s=MIN_DEADLINE_S, max_deadline_s=MAX_DEADLINE_S, seed=7, threads=1, run_id="rounds-test", ttl_s=10.0, overlap=OVERLAP)
    with Swarm(cfg, tmp_path_factory.mktemp("swarm")) as sw:
        sw.start()
        for name in ("a", "b", "c"):
            sw.add(name)
        sw.add("liar", program=program("corrupt"))
        sw.add("fat", program=program("oversize"))
        sw.add("slow", program=program(f"slow:{DELAY_S}"))
        yield sw


def _by_round(swarm: Swarm) -> dict[int, dict[str, dict[str, Any]]]:
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for name, recs in swarm.records().items():
        for rec in recs:
            out.setdefault(rec["round"], {})[name] = rec  # a restarted peer's later record of a round wins
    return out


def _wait_rounds(swarm: Swarm, names: list[str], n: int) -> dict[int, dict[str, dict[str, Any]]]:
    """Wait until each named replica has written at least ``n`` round records; returns all records by round."""
    poll(lambda: all(len(swarm.replicas[x].rounds()) >= n for x in names), ROUND_TIMEOUT_S,
         f"{names} to finish {n} rounds\n" + "\n".join(f"--- {x}\n{swarm.replicas[x].proc.output[-3000:]}"
                                                      for x in names))
    return _by_round(swarm)


def _state_round(rec: dict[str, Any]) -> int:
    """The round whose state a record's checksums describe: a later one when the peer resynced in that round (a
    straggler that could no longer fetch a round's contributions loads the swarm's latest state instead)."""
    return rec["round"] if rec["state_round"] is None else rec["state_round"]


def _rounds_as_of(swarm: Swarm, recs: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """All records by round, once a has written its record of the state of each record in ``recs`` (a peer writes a
    round's record when it has applied the round, so a faulty peer's may come first: seen as a KeyError on a loaded
    box)."""
    a = swarm.replicas["a"]
    last = max(_state_round(rec) for rec in recs)
    poll(lambda: a.rounds() and a.rounds()[-1]["round"] >= last, ROUND_TIMEOUT_S, f"a to record round {last}")
    return _by_round(swarm)


def _peer_id(r: Replica) -> str:
    return r.proc.wait_for(r"^connected as (\S+)", 60).group(1)


def test_checksums_agree_every_round_and_loss_falls(swarm: Swarm) -> None:
    try:
        rounds = _wait_rounds(swarm, ["a", "b", "c"], 3)
    finally:  # the mid-run joiner of test_joiner_syncs_and_contributes, whatever this test finds
        swarm.add("late")  # it syncs while the others go on
    for r in range(3):
        in_sync = [rec for rec in rounds[r].values() if rec["in_sync"]]
        assert len(in_sync) >= 3 and checksums_agree(in_sync), (r, rounds[r])
        assert {"a", "b", "c"} <= {n for n, rec in rounds[r].items() if rec["accepted"]}, (r, rounds[r])
    losses = [rounds[r]["a"]["val_loss"] for r in range(3)]
    assert losses[2] < losses[0], losses


def test_corrupt_payload_is_rejected_and_banned(swarm: Swarm) -> None:
    liar = _peer_id(swarm.replicas["liar"])
    everyone = [r.proc for r in swarm.replicas.values()]  # whoever coordinated (a liar runs honest code too)
    line = poll(lambda: next((m for p in everyone for m in p.find(rf"rejected the contribution of {liar[:16]}"
                                                                     r".*banned until round (\d+)")), None),
                ROUND_TIMEOUT_S, "a coordinator to reject the liar")
    assert int(line.group(1)) >= 2
    # the ban travels in the accepted sets: the honest replicas' round records carry it
    poll(lambda: any(liar in rec["banned"] for n in ("a", "b", "c") for rec in swarm.replicas[n].rounds()),
         ROUND_TIMEOUT_S, "the liar's ban to reach the honest replicas")
    liar_recs = swarm.replicas["liar"].rounds()
    assert liar_recs and not any(rec["accepted"] for rec in liar_recs)
    rounds = _rounds_as_of(swarm, liar_recs)
    for rec in liar_recs:  # rejected, yet it applies every round's result like everyone else
        if rec["in_sync"]:
            assert rec["checksums"] == rounds[_state_round(rec)]["a"]["checksums"], rec["round"]
    assert all(rounds[r]["a"]["accepted"] for r in range(3))


def test_oversized_payload_is_refused_unfetched_and_banned(swarm: Swarm) -> None:
    fat = _peer_id(swarm.replicas["fat"])
    everyone = [r.proc for r in swarm.replicas.values()]
    line = poll(lambda: next((m for p in everyone for m in p.find(rf"rejected the contribution of {fat[:16]} "
                                                                   r"\(announced ([\d,]+) bytes for shard \d+, above "
                                                                   r"the limit of ([\d,]+)\).*banned until round"))
                              , None), ROUND_TIMEOUT_S, "a coordinator to refuse the oversized payload")
    announced, limit = (int(g.replace(",", "")) for g in line.groups())
    assert announced > limit > 1 << 20
    _wait_rounds(swarm, ["a"], 3)
    fat_recs = swarm.replicas["fat"].rounds()
    assert fat_recs and not any(rec["accepted"] for rec in fat_recs)
    rounds = _rounds_as_of(swarm, fat_recs)
    for rec in fat_recs:  # refused, yet it applies every round's result like everyone else
        if rec["in_sync"]:
            assert rec["checksums"] == rounds[_state_round(rec)]["a"]["checksums"], rec["round"]
    # nobody downloaded it: an honest peer's received bytes stay far below one oversized payload
    assert max(rec["bytes_received"] for rec in swarm.replicas["a"].rounds()[:3]) < limit


def test_straggler_is_left_out_stays_in_sync_and_is_not_waited_for(swarm: Swarm) -> None:
    _wait_rounds(swarm, ["slow"], 2)
    slow = swarm.replicas["slow"].rounds()
    rounds = _rounds_as_of(swarm, slow)
    for rec in slow:
        # never a full phase: each is cut short, when the round closes without it (left out) or, in the phase after
        # a round it missed, once others announce the round (a catch-up: the few steps it made may then make the
        # window, as a partial contribution; measured in CI: accepted in its round 1 with the 2 s sleep per step)
        assert rec["steps"] < INNER_STEPS, rec
        assert rec["in_sync"] and rec["checksums"] == rounds[_state_round(rec)]["a"]["checksums"], rec["round"]
    assert not all(rec["accepted"] for rec in slow), slow
    for rec in slow:  # a resync says so on the console (in CI it could no longer fetch round 1 and loaded round 3)
        if rec["state_round"] is not None:
            assert rec["synced"] and rec["state_round"] > rec["round"], rec
            assert swarm.replicas["slow"].proc.find(rf"^round {rec['round']}: .*, resynced to round "
                                                    rf"{rec['state_round']}$"), rec
    honest = [rec for name in ("a", "b", "c") for rec in swarm.replicas[name].rounds()]
    # no honest wait outlasts the longest window; waiting for the straggler's phase would take it to about 20 s (7 s
    # was seen with the box's 2 cores also running two busy loops)
    assert max(rec["wait_s"] for rec in honest) < MAX_DEADLINE_S, [rec["wait_s"] for rec in honest]


def test_sigkill_mid_round_survivors_complete_and_agree(swarm: Swarm) -> None:
    # the faulty peers have shown what they do; they leave now so that the faults that follow play out among honest
    # peers, whose timing on 2 cores is what the bounds below assume (7 peers' 21 processes were sharing them)
    for name in ("liar", "fat", "slow"):
        swarm.replicas[name].proc.kill()
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
        rounds = _by_round(swarm)
        return all(n in rounds.get(killed_in + 1, {}) for n in ("a", "b"))

    poll(survivors_done, ROUND_TIMEOUT_S, f"a and b to finish rounds {killed_in} and {killed_in + 1} without c")
    for r in (killed_in, killed_in + 1):
        a, b = rounds[r]["a"], rounds[r]["b"]
        assert a["in_sync"] and b["in_sync"] and a["checksums"] == b["checksums"], (r, a, b)
        assert a["accepted"] and b["accepted"], (r, a, b)
        # closed by the deadline, not by waiting for c: at most the longest window (c, dead before it announced,
        # is no coordinator to take over from) plus one takeover's slack for a loaded machine
        assert max(a["wait_s"], b["wait_s"]) <= MAX_DEADLINE_S + TAKEOVER_S, (r, a["wait_s"], b["wait_s"])
    assert not c.proc.alive


def test_joiner_syncs_and_contributes(swarm: Swarm) -> None:
    late = swarm.replicas["late"]
    line = late.proc.wait_for(r"^replica: (.*); starting at round (\d+)", ROUND_TIMEOUT_S)
    assert line.group(1).startswith("synced round"), line.group(0)
    _wait_rounds(swarm, ["late"], 2)
    first = swarm.replicas["late"].rounds()[:2]
    assert any(rec["accepted"] for rec in first), first
    recs = _rounds_as_of(swarm, first)
    for rec in first:
        assert rec["in_sync"] and rec["checksums"] == recs[_state_round(rec)]["a"]["checksums"], rec


# Rounds within which a restarted peer is accepted again, counting the round it sits out after a state sync.
# Without overlap: that round and the next. Under overlap the next is a catch-up phase (rounds/loop.py) that ends
# once others announce its round, and on 8 processes sharing 2 cores its notice can still miss the 2 s window (its
# first step ran 1.4-1.6 s beside the background apply of the round it sat out). Since a synced peer pushes its
# checksums (and so hears of the next notices by push), 10 restarts of 10 were accepted in that round (3 of 10
# before). On a slower day of the same box (the whole suite 30 % slower) a restart missed the window in its
# catch-up round and again in the next, cut short to 4 of 6 steps, then went on (2 fresh-clone failures in about
# 10 runs, both under eager, none logged a fetch failure: the notice came after the close; a third in CI missed 5
# rounds in a row beside the faulty peers, which now leave before the restarts). The bound keeps three rounds of
# slack: what it checks is that a restarted peer is taken back, not how fast on 2 shared cores.
WITHIN = 2 if OVERLAP == "none" else 5


def test_restarted_peers_resume_or_sync_and_are_accepted_again(swarm: Swarm) -> None:
    b = swarm.replicas["b"]
    assert b.proc.stop(timeout=30) == 0, b.proc.output[-2000:]
    assert b.proc.find("leaving: marking this peer offline")
    before = {name: len(swarm.replicas[name].rounds()) for name in ("b", "c")}
    for name in ("b", "c"):  # b stopped cleanly, c was SIGKILLed by the test above; both come back at once
        swarm.add(name)
    for name in ("b", "c"):
        again = swarm.replicas[name]
        line = again.proc.wait_for(r"^replica: (.*); starting at round (\d+)", ROUND_TIMEOUT_S)
        assert line.group(1).startswith(("resumed", "synced")), line.group(0)
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
    rounds = _by_round(swarm)
    last = max(r for r, recs in rounds.items() if {"a", "b", "c"} <= set(recs))
    assert checksums_agree([rounds[last][n] for n in ("a", "b", "c")]), rounds[last]
