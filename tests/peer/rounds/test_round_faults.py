"""The round protocol against faulty peers, checked on one swarm of real ``hlbp join`` processes on 127.0.0.1.

Three honest replicas (a, b, c), two lying ones (liar, serving corrupt payloads, and fat, announcing payloads above
the size limit) and a straggler (slow, sleeping after every inner step) start together. The tests only watch the
swarm, each waiting with a deadline for the rounds it inspects, so each runs alone or in any order. Peers that
join, die and restart are tests/peer/rounds/test_round_churn.py's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from faulty_peer import program
from round_records import (
    CLOSE_SLACK_S,
    INNER_STEPS,
    MAX_DEADLINE_S,
    ROUND_TIMEOUT_S,
    rounds_as_of,
    rounds_config,
    state_round,
    wait_rounds,
)

from hlbp.peer.node.replica import RECOMPUTE_NOTE
from hlbp.peer.sim.launcher import Replica, Swarm, checksums_agree, poll

pytestmark = pytest.mark.slow

DELAY_S = 4.0  # the straggler's sleep per inner step: 24 s of inner phase against the honest peers' few seconds


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with Swarm(rounds_config(), tmp_path_factory.mktemp("swarm")) as sw:
        sw.start()
        for name in ("a", "b", "c"):  # c recomputes its blocks in the backward: the same bits, so the same rounds
            sw.add(name, *(["--recompute"] if name == "c" else []))
        sw.add("liar", program=program("corrupt"))
        sw.add("fat", program=program("oversize"))
        sw.add("slow", program=program(f"slow:{DELAY_S}"))
        yield sw


def _peer_id(r: Replica) -> str:
    return r.proc.wait_for(r"^connected as (\S+)", 60).group(1)


def test_checksums_agree_every_round_and_loss_falls(swarm: Swarm) -> None:
    rounds = wait_rounds(swarm, ["a", "b", "c"], 3)
    for r in range(3):
        in_sync = [rec for rec in rounds[r].values() if rec["in_sync"]]
        assert len(in_sync) >= 3 and checksums_agree(in_sync), (r, rounds[r])
        assert {"a", "b", "c"} <= {n for n, rec in rounds[r].items() if rec["accepted"]}, (r, rounds[r])
    assert swarm.replicas["c"].proc.find(rf"^replica: .*{re.escape(RECOMPUTE_NOTE)}$")
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
    # the liar writes its own records after the honest replicas' (a loaded box can hold it back a round): wait
    liar_recs = poll(lambda: swarm.replicas["liar"].rounds() or None, ROUND_TIMEOUT_S, "the liar's round records")
    assert not any(rec["accepted"] for rec in liar_recs)
    rounds = rounds_as_of(swarm, liar_recs)
    for rec in liar_recs:  # rejected, yet it applies every round's result like everyone else
        if rec["in_sync"]:
            assert rec["checksums"] == rounds[state_round(rec)]["a"]["checksums"], rec["round"]
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
    wait_rounds(swarm, ["a"], 3)
    fat_recs = swarm.replicas["fat"].rounds()
    assert fat_recs and not any(rec["accepted"] for rec in fat_recs)
    rounds = rounds_as_of(swarm, fat_recs)
    for rec in fat_recs:  # refused, yet it applies every round's result like everyone else
        if rec["in_sync"]:
            assert rec["checksums"] == rounds[state_round(rec)]["a"]["checksums"], rec["round"]
    # nobody downloaded it: an honest peer's received bytes stay far below one oversized payload
    assert max(rec["bytes_received"] for rec in swarm.replicas["a"].rounds()[:3]) < limit


def test_straggler_is_left_out_stays_in_sync_and_is_not_waited_for(swarm: Swarm) -> None:
    wait_rounds(swarm, ["slow"], 2)
    slow = swarm.replicas["slow"].rounds()
    rounds = rounds_as_of(swarm, slow)
    for rec in slow:
        # never a full phase: each is cut short, when the round closes without it (left out) or, in the phase after
        # a round it missed, once others announce the round (a catch-up: the few steps it made may then make the
        # window, as a partial contribution; measured in CI: accepted in its round 1 with the 2 s sleep per step)
        assert rec["steps"] < INNER_STEPS, rec
        assert rec["in_sync"] and rec["checksums"] == rounds[state_round(rec)]["a"]["checksums"], rec["round"]
    assert not all(rec["accepted"] for rec in slow), slow
    for rec in slow:  # a resync says so on the console (in CI it could no longer fetch round 1 and loaded round 3)
        if rec["state_round"] is not None:
            assert rec["synced"] and rec["state_round"] > rec["round"], rec
            assert swarm.replicas["slow"].proc.find(rf"^round {rec['round']}: .*, resynced to round "
                                                    rf"{rec['state_round']}$"), rec
    honest = [(name, rec) for name in ("a", "b", "c") for rec in swarm.replicas[name].rounds()]
    # no honest wait outlasts the longest window and what the exchange takes after its close; waiting for the
    # straggler's phase would take it to about 20 s (7 s was seen with the box's 2 cores also running two busy
    # loops, 11.2 s in a loaded run of the whole suite; 21.8 s once in such a run, not reproduced since, so a
    # failure quotes the record and the console of the peer that waited)
    name, worst = max(honest, key=lambda pair: pair[1]["wait_s"])
    assert worst["wait_s"] < MAX_DEADLINE_S + CLOSE_SLACK_S, (
        f"{name} waited {worst['wait_s']} s in round {worst['round']}: {worst}\n"
        f"{swarm.replicas[name].proc.output[-6000:]}\n--- slow\n{swarm.replicas['slow'].proc.output[-3000:]}")
