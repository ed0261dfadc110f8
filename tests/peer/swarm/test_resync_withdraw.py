"""An honest stage peer whose state was damaged, as real ``hlbp join`` processes on loopback: two full replicas and a
2-stage swarm whose driver's shard is damaged right after it applies round 2 (``corrupt_state_peer.py``).

The driver's next phase trains from the damaged state, and its verification of round 2, held until that phase has
begun, finds it out of sync and resyncs it under the phase. What must hold: the driver takes that phase back at
once (its audit index withdraws the round), so the coordinator's audit of the round recomputes none of its frames,
leaves out the swarm's work of that round and convicts nobody; the driver is never banned, and the swarm's work is
accepted again in a later round. Without the withdrawal the audit recomputes the phase's first step at the agreed
anchor and convicts the driver of lying (its frames came from the damaged weights).

``late``: the verification is held until the round of that phase has closed as well, so the coordinator audits the
phase's frames before the driver can withdraw them, and finds them wrong. What must hold then: the driver's own
checksums of round 2, published before, differ from the anchor's, so the audit records the frames as disowned,
not as a lie; nobody is convicted or banned, and the swarm's work of that round is left out and dropped as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from corrupt_state_peer import program

from hlbp.peer.sim.launcher import SimConfig, Swarm
from hlbp.peer.sim.report import checksums_agree

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0  # a bound on a few rounds of small steps on 2 busy cores, not an expected duration
DAMAGED = 2  # the round after whose apply the driver's state is damaged


@pytest.mark.parametrize("late", [False, True], ids=["withdrawn", "verified-after-the-audits"])
def test_a_stage_peer_resynced_under_its_phase_withdraws_it_and_is_not_convicted(tmp_path: Path, late: bool) -> None:
    cfg = SimConfig(n_stages=2, inner_steps=4, batch_size=4, seq_len=64, seed=6, run_id="withdraw", ttl_s=8.0,
                    micro_batches=2)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add_stage("s1", 1).proc.wait_for("^announced", 60)
        fulls = [sw.add(f"peer{i}", "--wait-replicas", "4", rounds=1000) for i in range(2)]
        driver = sw.add_stage("s0", 0, "--micro-batches", "2", "--eval-every", "0", program=program(DAMAGED, late))
        ids = {n: r.proc.wait_for(r"^connected as (\S+)", 60).group(1) for n, r in sw.replicas.items()}
        withdrawn = DAMAGED + 1
        driver.proc.wait_for("damaged the state after round 2", TIMEOUT_S)

        def audits() -> list[dict[str, Any]]:
            return [a for f in fulls for a in f.events("audit")]

        # the coordinator of the damaged phase's round audits the driver and finds the round withdrawn, or, when
        # it audited before the driver knew, frames its own checksums had disowned
        found = sw.wait(lambda: next((a for a in audits() if a["round"] == withdrawn and a["peer"] == ids["s0"]),
                                     None), "the audit of the driver's damaged phase")
        assert not found["guilty"] and ids["s1"] in found["neighbours"], found
        if late:
            assert found["disowned"] and not found["withdrawn"] and found["samples"], found
            assert any(x["finding"] != "clean" for x in found["samples"]), found  # its frames were wrong
            # the driver's own line may come after the coordinator's audit record: waited for, not read once
            driver.proc.wait_for(f"verifying round {DAMAGED} after round {withdrawn} closed", TIMEOUT_S)
        else:
            assert found["withdrawn"] and found["samples"] == [], found
            assert driver.proc.find(rf"round {withdrawn}: this stage's phase trained from a state a resync replaced")
        # the swarm's work is taken again later, and nobody was convicted or banned for the damage
        back = sw.wait(lambda: next((r["round"] for r in driver.events("round")
                                     if r["round"] > withdrawn and r["accepted"]), None),
                       "the swarm's work to be accepted again")
        rounds = [r for f in fulls for r in f.events("round") if r["round"] <= back]
        assert not any(a["guilty"] for a in audits()), [a for a in audits() if a["guilty"]]
        assert not any(ids["s0"] in r["banned"] or ids["s1"] in r["banned"] for r in rounds), rounds
        # the last stage's work of the withdrawn round, computed from the damaged frames, was not taken
        last = sw.wait(lambda: next((r for r in sw.replicas["s1"].events("round") if r["round"] == withdrawn),
                                    None), "the last stage's record of the withdrawn round")
        # and was taken out of its error feedback (the accepted set named it dropped), not kept for a later round
        assert last["contributed"] and not last["accepted"] and last["dropped"], last
        # every peer of the run agrees on the state of every round up to then (the driver from its resync on).
        # Held late, the driver's verification of the damaged round runs after the full replicas replaced their
        # checksum records of it with the next round's: it reads their votes on it from those records
        # (ShardChecks.previous), not its own alone, so it finds the damage in that round too
        records = {n: r.events("round") for n, r in sw.replicas.items() if n != "bootstrap"}
        for r in range(back + 1):
            assert checksums_agree(rec for recs in records.values() for rec in recs if rec["round"] == r), r
