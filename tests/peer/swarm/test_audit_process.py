"""A lying middle stage in a run's rounds, as real ``hlbp join`` processes on loopback: a full replica and a 3-stage
swarm whose stage-1 peer lies: noise of the right scale instead of its activations, its activations x10, its
gradients sign-flipped (each on every micro-batch), or noise instead of its activations on one micro-batch in ten.

What must hold: the full replica, coordinating, audits the stage peers' traffic before it accepts their
contributions, finds the liar guilty on a round's samples from its own signed frames (within 2 rounds of the
swarm's first contribution), bans it, and refuses that round's contributions of the whole swarm (they were computed
on what the liar sent); the driver routes around the banned peer, so the swarm's work is never in an accepted set
again until an honest peer of stage 1 joins (shown for the first lie), and then it is, audited clean; the full
replica's loss falls throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
from lying_stage_peer import program

from hlbp.peer.sim.launcher import Replica, SimConfig, Swarm

pytestmark = pytest.mark.slow

H = 4


def _peer_id(r: Replica) -> str:
    return r.proc.wait_for(r"^connected as (\S+)", 60).group(1)


def _start(sw: Swarm, liar: list[str], wait_replicas: int) -> tuple[Replica, Replica, dict[str, str]]:
    """The bootstrap, the lying stage-1 peer (``liar``: its command), stage 2, the full replica (waiting for
    ``wait_replicas`` contributors before its first round) and the driver; (full replica, driver, peer ids)."""
    sw.start()
    sw.add_stage("s1", 1, program=liar).proc.wait_for("^announced", 60)
    sw.add_stage("s2", 2).proc.wait_for("^announced", 60)
    full = sw.add("peer0", "--wait-replicas", str(wait_replicas), rounds=1000)
    driver = sw.add_stage("s0", 0, "--micro-batches", "2", "--eval-every", "0")
    return full, driver, {n: _peer_id(sw.replicas[n]) for n in ("s0", "s1", "s2", "peer0")}


@pytest.mark.parametrize("lie", ["forward:noise", "forward:scale", "backward:flip", "forward:noise:10"])
def test_a_lying_middle_stage_is_caught_banned_and_its_swarms_work_never_accepted(tmp_path: Path, lie: str) -> None:
    cfg = SimConfig(n_stages=3, inner_steps=H, batch_size=4, seq_len=64, seed=4, run_id="audit", ttl_s=8.0,
                    micro_batches=2)
    with Swarm(cfg, tmp_path) as sw:
        full, driver, ids = _start(sw, program(lie), wait_replicas=4)

        # the swarm's first contributions are audited in the round they are sent for
        caught = sw.wait(lambda: next((a for a in full.events("audit") if a["guilty"]), None),
                         "the full replica to catch the liar")
        assert caught["peer"] == ids["s1"] and caught["stage"] == 1, caught
        assert set(caught["neighbours"]) == {ids["s0"], ids["s2"]}, caught
        # convicted by what it lied about (a later step whose frames are all lies may be unjudged beside it)
        bad = [s for s in caught["samples"] if s["finding"] not in ("clean", "unjudged")]
        assert bad and all(s["finding"] == lie.split(":")[0] for s in bad), caught
        detected = caught["round"]
        sent = sw.wait(lambda: [r["round"] for r in driver.events("round")
                                if r["round"] <= detected and r["contributed"]] or None,
                       "the driver's record of the round it was caught in")
        first_sent = min(sent)
        assert detected <= first_sent + 1, (detected, first_sent)
        # honest stage peers are audited too, and clean
        assert any(a["peer"] == ids["s2"] and not a["guilty"] for a in full.events("audit"))

        # from the round of detection on, no accepted set holds the swarm's work; the full replica goes on
        sw.wait(lambda: [r for r in full.events("round") if r["round"] >= detected + 2] or None,
                "two more rounds of the full replica")
        rounds = [r for r in full.events("round") if r["round"] >= detected]
        assert all(r["members"] == 1 and r["accepted"] for r in rounds), rounds  # the full replica's alone
        for name in ("s0", "s1", "s2"):
            assert not any(r["accepted"] for r in sw.replicas[name].events("round") if r["round"] >= detected)
        assert any(ids["s1"] in r["banned"] for r in rounds), rounds
        # its neighbours' work of that round was computed with its frames: dropped, not kept for a later round
        for name in ("s0", "s2"):
            rec = sw.wait(lambda n=name: next((r for r in sw.replicas[n].events("round")
                                               if r["round"] == detected), None), f"{name}'s record of the round")
            assert rec["tainted"] and not rec["accepted"], rec
        if lie != "forward:noise":
            return

        # an honest peer of stage 1 joins: the swarm's chain runs through it and its work is accepted again, audited
        # clean from the frames it exchanged with the new peer
        honest_id = _peer_id(sw.add_stage("s1b", 1, swarm=0))
        back = sw.wait(lambda: next((r["round"] for r in driver.events("round")
                                     if r["round"] > detected and r["accepted"]), None),
                       "the swarm's contributions to be accepted again")
        audits = {a["peer"]: a for a in full.events("audit") if a["round"] == back}
        assert ids["s1"] not in audits and not any(a["guilty"] for a in audits.values()), audits
        last = audits[ids["s2"]]
        assert last["neighbours"] == [honest_id] and last["samples"], last
        # the first step exactly clean; a later step clean, or unjudged where drift left no informative sibling
        assert [s["finding"] for s in last["samples"] if s["inner"] == 0] == ["clean"], last
        assert all(s["finding"] in ("clean", "unjudged") for s in last["samples"]), last
        losses = [r["val_loss"] for r in full.events("round") if r.get("val_loss") is not None]
        assert losses[-1] < losses[0], losses


def test_a_lying_driver_is_caught_from_its_signed_input_and_its_whole_chain_drops_the_round(tmp_path: Path) -> None:
    """Stage 0 (the swarm's driver) sends its activations x10. The run's dense codec carries no token ids: the
    auditor reads the driver's input from the token window it signed with its output frame, convicts it, and
    refuses the round's work
    of its neighbour and of the last stage two hops away, which drop it too (the last stage never received a frame
    from the liar: it drops its work because the round banned a peer of its own swarm)."""
    cfg = SimConfig(n_stages=3, inner_steps=H, batch_size=4, seq_len=64, seed=5, run_id="audit-driver", ttl_s=8.0,
                    micro_batches=2)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        sw.add_stage("s1", 1).proc.wait_for("^announced", 60)
        sw.add_stage("s2", 2).proc.wait_for("^announced", 60)
        full = sw.add("peer0", "--wait-replicas", "4", rounds=1000)
        sw.add_stage("s0", 0, "--micro-batches", "2", "--eval-every", "0", program=program("forward:scale"))
        ids = {n: _peer_id(sw.replicas[n]) for n in ("s0", "s1", "s2", "peer0")}
        caught = sw.wait(lambda: next((a for a in full.events("audit") if a["guilty"]), None),
                         "the full replica to catch the lying driver")
        assert caught["peer"] == ids["s0"] and caught["stage"] == 0 and caught["neighbours"] == [ids["s1"]], caught
        assert [s["finding"] for s in caught["samples"] if s["inner"] == 0] == ["forward"], caught
        detected = caught["round"]
        sw.wait(lambda: [r for r in full.events("round") if r["round"] >= detected + 1] or None,
                "a further round of the full replica")
        rounds = [r for r in full.events("round") if r["round"] >= detected]
        assert all(r["members"] == 1 and r["accepted"] for r in rounds), rounds
        assert ids["s0"] in rounds[0]["banned"], rounds[0]
        for name in ("s1", "s2"):  # the neighbour and the stage two hops away
            rec = sw.wait(lambda n=name: next((r for r in sw.replicas[n].events("round")
                                               if r["round"] == detected), None), f"{name}'s record of the round")
            assert rec["contributed"] and rec["tainted"] and not rec["accepted"], (name, rec)


def test_a_liar_that_never_contributes_is_audited_through_its_neighbours_and_its_chain_drops_the_round(
        tmp_path: Path) -> None:
    """Stage 1 flips its gradients on every micro-batch and never announces a contribution of its own, so no audit of
    a contribution looks at it directly, while its neighbours' honest computations on what it sent would pass their
    own audits. Their transcripts name it: the full replica audits it too, convicts it from its own signed frames,
    bans it and refuses its neighbours' work of the round, which they drop; the swarm's work is never accepted."""
    cfg = SimConfig(n_stages=3, inner_steps=H, batch_size=4, seq_len=64, seed=4, run_id="audit-silent", ttl_s=8.0,
                    micro_batches=2)
    with Swarm(cfg, tmp_path) as sw:
        full, driver, ids = _start(sw, program("backward:flip:1:silent"), wait_replicas=3)
        caught = sw.wait(lambda: next((a for a in full.events("audit") if a["guilty"]), None),
                         "the full replica to catch the silent liar")
        assert caught["peer"] == ids["s1"] and caught["stage"] == 1, caught
        assert [s["finding"] for s in caught["samples"] if s["inner"] == 0] == ["backward"], caught
        detected = caught["round"]
        first_sent = min(sw.wait(lambda: [r["round"] for r in driver.events("round") if r["contributed"]]
                                       or None, "the driver's first contribution"))
        assert detected == first_sent, (detected, first_sent)  # the round its poison would have entered
        sw.wait(lambda: [r for r in full.events("round") if r["round"] >= detected + 1] or None,
                "a further round of the full replica")
        rounds = [r for r in full.events("round") if r["round"] <= detected + 1]
        assert all(r["members"] == 1 and r["accepted"] for r in rounds), rounds  # the full replica's alone
        assert ids["s1"] in next(r for r in rounds if r["round"] == detected)["banned"], rounds
        for name in ("s0", "s2"):
            rec = sw.wait(lambda n=name: next((r for r in sw.replicas[n].events("round")
                                               if r["round"] == detected), None), f"{name}'s record of the round")
            assert rec["contributed"] and rec["tainted"] and not rec["accepted"], (name, rec)
            assert not any(r["accepted"] for r in sw.replicas[name].events("round"))
