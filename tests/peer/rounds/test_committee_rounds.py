"""A run with a round committee, with real ``hlbp join`` processes on 127.0.0.1: eight replicas, F = 2, W = 5.

From round 2 on (a committee is drawn from round r - 2's members and those before), each notice goes to one
holder, the holders forward what the gather rule could select to the leads, the coordinator sends the accepted set
to the seats and they relay it; after a round each peer reads four seats' checksums. Every round's checksums must
still agree, and a peer must receive far fewer round records than when every record goes to every peer (rounds 0
and 1 of the same run, and the 2 (N - 1) pushes a round all-to-all costs at least). A holder killed mid-run costs
the others no agreement, which needs every peer to judge a set alike (the cap only) and a peer that resyncs to
learn the committee from the records.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from statistics import mean

import pytest
from round_records import wait_rounds

from hlbp.peer.rounds.committee import CommitteeRule, committee, leads
from hlbp.peer.sim.launcher import SimConfig, Swarm, checksums_agree

pytestmark = pytest.mark.slow

N = 8
NAMES = [f"r{i}" for i in range(N)]
ROUNDS = 7  # rounds checked: 0 and 1 all-to-all, 2..6 with a committee


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    workdir: Path = tmp_path_factory.mktemp("committee")
    cfg = SimConfig(n_full=0, rounds=ROUNDS + 12, inner_steps=4, batch_size=4, seq_len=64, round_deadline_s=8.0,
                    min_deadline_s=4.0, max_deadline_s=20.0, seed=5, threads=1, run_id="committee-test", ttl_s=10.0,
                    gather=2, reserves=1, committee=5)
    with Swarm(cfg, workdir) as sw:
        sw.start()
        for name in NAMES:
            sw.add(name, "--wait-replicas", str(N))
        yield sw


def test_rounds_with_a_committee_agree_and_each_peer_hears_few_records(swarm: Swarm) -> None:
    rounds = wait_rounds(swarm, NAMES, ROUNDS)
    for r in range(ROUNDS):
        recs = [rounds[r][x] for x in NAMES]
        assert all(rec["members"] <= 2 and rec["in_sync"] for rec in recs), (r, recs)
        assert checksums_agree(recs), (r, recs)
    received = {r: mean(rounds[r][x]["records_received"] for x in NAMES) for r in range(ROUNDS)}
    all_to_all = mean(received[r] for r in (0, 1))
    committee = mean(received[r] for r in range(2, ROUNDS))
    # all-to-all, a peer is pushed every other peer's notice and checksums: 2 (N - 1) records a round at least
    assert committee < 2 * (N - 1), received
    assert committee < 0.6 * all_to_all, received


def test_a_holder_killed_mid_run_leaves_the_others_rounds_agreeing(swarm: Swarm) -> None:
    """SIGKILL a holder of a coming round's committee (computed from the sets the replicas took, as every peer
    computes it): its part of the notices is lost for that round, the leads close without it after asking, and the
    survivors' rounds go on with equal checksums."""
    rounds = wait_rounds(swarm, NAMES, ROUNDS)
    ids = {x: swarm.replicas[x].peer_id for x in NAMES}
    name_of = {p: x for x, p in ids.items()}
    k = max(r for r, recs in rounds.items() if set(NAMES) <= set(recs))
    members = [{ids[x] for x in NAMES if rounds[r][x]["accepted"]} for r in range(k, -1, -1)]  # newest first
    seats = committee(k + 2, members, CommitteeRule(5))
    victim = name_of[seats[-1]]  # a holder (the leads are the first three seats)
    assert seats[-1] not in leads(seats, CommitteeRule(5))
    swarm.replicas[victim].proc.kill()
    survivors = [x for x in NAMES if x != victim]
    after = wait_rounds(swarm, survivors, k + 5)
    for r in range(k + 2, k + 5):
        recs = [after[r][x] for x in survivors]
        # rounds go on: each closes with members, and the survivors that hold its state agree on it
        assert any(rec["members"] for rec in recs), (r, recs)
        assert checksums_agree(recs), (r, recs)
    # a survivor that could not fetch a payload the dead holder served is back in sync by the last round
    assert all(after[k + 4][x]["in_sync"] for x in survivors), after[k + 4]
