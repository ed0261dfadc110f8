"""A closed run under attack, with real ``hlbp join`` processes on 127.0.0.1.

The manifest's allow-list names a, b, a lying coordinator (liar) and a peer that freezes (f); an outsider with its
own key joins too. Identities are drawn so that the liar coordinates round 0 and f does not coordinate round 2.

- The outsider's contributions and records are ignored by everyone (and logged once), and it is never accepted.
- Round 0: the liar accepts its own outsized lookup table; every peer's guard refuses the round as a whole
  (nobody's parameters move, the checksums agree) and bans the liar, which then coordinates no more.
- Round 2: f freezes (SIGSTOP) right after announcing its contribution, so the coordinator is fetching from a
  peer that is alive but does not answer. SIGTERM to a, b and the liar must end each within 10 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty_peer import program
from round_records import write_keys

from hlbp.peer.rounds.rules import coordinator_order
from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree, poll
from hlbp.protocol.identity import Identity

pytestmark = pytest.mark.slow

MEMBERS = ("a", "b", "liar", "f")
FREEZE_ROUND = 2
LEAVE_WITHIN_S = 10.0  # what a spot instance gets between SIGTERM and SIGKILL
ROUND_TIMEOUT_S = 120.0


def _identities() -> dict[str, Identity]:
    """Members such that the liar ranks first in round 0 and f is not first in round 2 (the liar is banned then)."""
    while True:
        ids = {name: Identity.generate() for name in (*MEMBERS, "outsider")}
        peer = {name: ident.peer_id for name, ident in ids.items()}
        first0 = coordinator_order(0, [peer[x] for x in MEMBERS])[0]
        first2 = coordinator_order(FREEZE_ROUND, [peer[x] for x in ("a", "b", "f")])[0]
        if first0 == peer["liar"] and first2 != peer["f"]:
            return ids


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, str]]]:
    ids = _identities()
    workdir: Path = tmp_path_factory.mktemp("closed")
    peer = write_keys(workdir, ids)
    cfg = SimConfig(n_full=0, rounds=60, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=4.0,
                    min_deadline_s=2.0, max_deadline_s=10.0, seed=3, threads=1, run_id="closed-test", ttl_s=10.0,
                    allowed_peers=tuple(sorted(peer[x] for x in MEMBERS)), stop_timeout_s=5.0)
    with Swarm(cfg, workdir) as sw:
        sw.start()
        wait = ("--wait-replicas", str(len(MEMBERS)))
        # The outsider starts first and waits at the gate for the members (it counts only them), so it plays the
        # same rounds they do however slowly the machine loads the processes.
        outsider = sw.add("outsider", *wait)
        outsider.proc.wait_for("before round 0", ROUND_TIMEOUT_S)
        sw.add("a", *wait)
        sw.add("b", *wait)
        sw.add("liar", *wait, program=program("lying-coordinator"))
        sw.add("f", *wait, program=program(f"freeze:{FREEZE_ROUND}"))
        yield sw, peer


def test_the_lying_coordinators_round_is_refused_by_everyone(swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, peer = swarm
    poll(lambda: all(len(sw.replicas[x].rounds()) >= 2 for x in ("a", "b")), ROUND_TIMEOUT_S,
         lambda: "a and b to finish 2 rounds\n" + sw.replicas["a"].proc.output[-3000:])
    first = {x: sw.replicas[x].rounds()[0] for x in ("a", "b")}
    assert all(rec["round"] == 0 and rec["refused"] for rec in first.values()), first
    assert "norm bound" in first["a"]["refused"]
    assert checksums_agree(first.values())
    second = {x: sw.replicas[x].rounds()[1] for x in ("a", "b")}
    assert all(not rec["refused"] and rec["accepted"] for rec in second.values()), second
    assert peer["liar"] in second["a"]["banned"] and checksums_agree(second.values())
    assert all(rec["checksums"] != first["a"]["checksums"] for rec in second.values())  # round 1 moved on


def test_an_outsider_is_ignored_and_never_accepted(swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, peer = swarm
    outsider = sw.replicas["outsider"]
    outsider.proc.wait_for("is not in run closed-test's allow-list", 60)
    line = f"ignoring round records of {peer['outsider'][:16]}: it is not in the run's allow-list"
    # A member logs the outsider when it reads the outsider's records, and those exist only in round 0: the outsider
    # never syncs (nobody serves it), so it never contributes again. The transport refuses the outsider's pushes, so
    # a member that closed round 0 on pushed records alone, before its first DHT read of the round completed, never
    # reads them at all (seen for both members on a loaded box). So the test waits until a member logs it or both
    # are past the rounds its records could be read in; whoever logged it logged it once.
    procs = [sw.replicas[name].proc for name in ("a", "b")]
    poll(lambda: any(p.find(line) for p in procs)
         or all(len(sw.replicas[name].rounds()) >= 3 for name in ("a", "b")), ROUND_TIMEOUT_S,
         "a member to log the outsider, or both to finish 3 rounds")
    assert all(len(p.find(line)) <= 1 for p in procs)  # logged once, not at every poll
    for name in ("a", "b"):
        assert all(rec["members"] <= len(MEMBERS) for rec in sw.replicas[name].rounds())
    assert not any(rec["accepted"] for rec in outsider.rounds())


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc to see that the peer is frozen")
def test_sigterm_leaves_within_seconds_while_fetching_from_a_frozen_peer(
        swarm: tuple[Swarm, dict[str, str]]) -> None:
    sw, _peer = swarm
    frozen = sw.replicas["f"].proc
    frozen.wait_for(f"freezing in round {FREEZE_ROUND}", ROUND_TIMEOUT_S)
    poll(lambda: _stopped(frozen.popen.pid), 10, "f to be stopped")
    time.sleep(3.0)  # not synchronisation: lets the coordinator's fetch from the frozen peer get under way
    leavers = [sw.replicas[x].proc for x in ("a", "b", "liar")]
    assert all(p.alive for p in leavers)
    start = time.monotonic()
    for p in leavers:
        p.popen.send_signal(signal.SIGTERM)
    took = {}
    for p in leavers:
        p.popen.wait(timeout=LEAVE_WITHIN_S + 20)
        took[p.name] = time.monotonic() - start
    print(f"SIGTERM to exit, seconds: {took}")
    assert max(took.values()) < LEAVE_WITHIN_S, took
    assert all(p.popen.returncode == 0 for p in leavers), {p.name: p.output[-2000:] for p in leavers}
    os.kill(frozen.popen.pid, signal.SIGCONT)  # let it take the SIGTERM of the swarm's teardown
