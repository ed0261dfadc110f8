"""A stage peer that withdraws its work of every round, as real ``hlbp join`` processes on loopback: two full
replicas and a 2-stage swarm whose only stage-1 peer at first serves indexes that withdraw every round
(``withdrawing_peer.py``).

Withdrawing is what an honest peer does once after a resync, so one withdrawal bans nobody; but each costs the
whole chain its round's work, and a peer that did it every round would keep its swarm's work out of the run for good
while nothing convicts it. What must hold: the coordinators' audits find its work withdrawn and convict nobody; a
coordinator whose audits find it withdrawn twice (of its last four there) bans it, as undelivered work (the ban travels
marked so: the driver's work is not tainted by it); each round it withdrew, the driver's contribution is left out
and named dropped in the accepted set, so the driver takes that phase out of its error feedback; the driver then
routes around it, to an honest stage-1 peer that joined after the first withdrawal was found, and the swarm's work
is accepted again; every round's checksums agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from withdrawing_peer import program

from hlbp.peer.sim.launcher import SimConfig, Swarm
from hlbp.peer.sim.report import checksums_agree

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0  # a bound on a few rounds of small steps on 2 busy cores, not an expected duration


def test_a_stage_peer_that_withdraws_every_round_is_banned_and_routed_around(tmp_path: Path) -> None:
    cfg = SimConfig(n_stages=2, inner_steps=4, batch_size=4, seq_len=64, seed=8, run_id="drag", ttl_s=8.0,
                    micro_batches=2, max_peers_per_stage=2)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add_stage("drag", 1, program=program(), swarm=0).proc.wait_for("^announced", 60)
        fulls = [sw.add(f"peer{i}", "--wait-replicas", "4", rounds=1000) for i in range(2)]
        driver = sw.add_stage("s0", 0, "--micro-batches", "2", "--eval-every", "0", swarm=0)
        ids = {n: r.proc.wait_for(r"^connected as (\S+)", 60).group(1) for n, r in sw.replicas.items()}

        def audits() -> list[dict[str, Any]]:
            return [a for f in fulls for a in f.events("audit") if a["peer"] == ids["drag"]]

        def banned_in() -> int | None:
            return next((r["round"] for f in fulls for r in f.events("round") if ids["drag"] in r["banned"]), None)

        sw.wait(lambda: next((a for a in audits() if a["withdrawn"]), None), "an audit to find its work withdrawn",
                TIMEOUT_S)
        # an honest peer of stage 1 joins now, a standby in sync for the driver to route through once it is banned
        # (started at once, the driver's chain might take it first; started after the ban, the swarm waited for a
        # chain while the full replicas' rounds went on, and fell behind them for good)
        ids["s1"] = sw.add_stage("s1", 1, swarm=0).proc.wait_for(r"^connected as (\S+)", 60).group(1)
        first_ban = sw.wait(banned_in, "a coordinator to ban the withdrawing peer", TIMEOUT_S)
        withdrawn = sorted({a["round"] for a in audits() if a["withdrawn"]})
        assert len(withdrawn) >= 2 and withdrawn[0] < first_ban, (withdrawn, first_ban)
        assert not any(a["guilty"] or a["samples"] for a in audits()), audits()
        assert driver.proc.alive and sw.replicas["drag"].proc.alive  # its frames were honest: nothing else failed
        # the swarm's work of the rounds the drag served was left out, the driver's included, and the driver took
        # such a phase out of its error feedback (the accepted set named it dropped): it does not come back later.
        # (A round whose coordinator got the driver's notice too late leaves it out as a straggler, unscreened.)
        served = [r for r in driver.events("round") if r["round"] in withdrawn and r["contributed"]]
        assert served and not any(r["accepted"] for r in served), served
        assert any(r["dropped"] for r in served), served

        back = sw.wait(lambda: next((r["round"] for r in driver.events("round")
                                     if r["round"] > first_ban and r["accepted"]), None),
                       "the swarm's work to be accepted again through the honest stage-1 peer", TIMEOUT_S)
        honest = sw.wait(lambda: next((r for r in sw.replicas["s1"].events("round") if r["round"] == back), None),
                         "the honest stage-1 peer's record of that round")
        assert honest["accepted"], honest
        # a ban for undelivered work taints nobody: the driver never dropped a phase for trading frames with it
        assert not any(r.get("tainted") for r in driver.events("round")), driver.events("round")
        assert not any(ids["s0"] in r["banned"] or ids["s1"] in r["banned"]
                       for f in fulls for r in f.events("round")), "an honest stage peer was banned"
        records = {n: r.events("round") for n, r in sw.replicas.items() if n != "bootstrap"}
        for r in range(back + 1):
            assert checksums_agree(rec for recs in records.values() for rec in recs if rec["round"] == r), r
