"""What one stage peer's audit does to a round's contributions (``judge``, pure): a conviction bans the liar and
leaves out its chain, a liar banned earlier taints who still trades frames with it, stale work leaves out its chain
without a ban, and work that could not be checked is not taken unless its stage cannot be recomputed at all; a
liar's whole chain of frame exchanges in the round is left out (``chain_of``), not its neighbours alone; two of a
peer's last four audits taking its work back ban it (``Withdrawals``)."""

from __future__ import annotations

from hlbp.peer.node.audits import (
    MAX_WITHDRAWERS,
    Convictions,
    Withdrawals,
    chain_of,
    checked,
    disowned,
    judge,
    unaudited_neighbours,
)
from hlbp.peer.swarm.audit import AuditResult, Comparison, Finding
from hlbp.peer.swarm.auditor import PeerAudit, Verdict

CLOSE = Comparison(0.0, 1.0, 1.0)


def audit(*findings: Finding, neighbours: tuple[str, ...] = ("up", "down"),
          fed_by: tuple[str, ...] | None = None) -> PeerAudit:
    """An audit of "p" whose frames ``neighbours`` hold (their transcripts say so) and whose transcript lists frames
    from ``fed_by`` (the same peers unless given: a pipeline's exchanges go both ways)."""
    verdicts = [Verdict("p", 4, (1, 9, i, 0), AuditResult(f, 0, CLOSE, CLOSE)) for i, f in enumerate(findings)]
    return PeerAudit("p", 4, verdicts, frozenset(neighbours),
                     fed_by=frozenset(neighbours if fed_by is None else fed_by))


def test_a_conviction_bans_the_liar_and_leaves_out_the_chain_it_fed() -> None:
    out = judge(audit(Finding.CLEAN, Finding.FORWARD), 1, set())
    assert out["p"].ban and "forward on step 9 micro-batch 1" in out["p"].reason
    assert {p for p, r in out.items() if not r.ban} == {"up", "down"}


def test_a_liar_banned_earlier_taints_whoever_still_trades_frames_with_it() -> None:
    out = judge(audit(Finding.CLEAN, Finding.CLEAN, neighbours=("liar", "down")), 2, {"liar"})
    assert set(out) == {"p"} and not out["p"].ban


def test_a_conviction_taints_for_as_long_as_its_ban_and_a_repeat_for_twice_as_long() -> None:
    c = Convictions()
    c.convict("liar", 20)
    assert [r for r in range(20, 30) if "liar" in c.liars(r)] == [20, 21, 22]  # banned until round 23
    c.convict("liar", 30)
    assert [r for r in range(30, 40) if "liar" in c.liars(r)] == [30, 31, 32, 33, 34]  # until 35: 4 rounds after
    assert c.liars(35) == set()  # then its neighbours' work is taken again, its own frames audited as anyone's


def test_stale_work_leaves_out_its_chain_and_bans_nobody() -> None:
    out = judge(audit(Finding.CLEAN, Finding.STALE), 1, set())
    assert set(out) == {"p", "up", "down"} and not any(r.ban for r in out.values())


def test_withdrawn_work_leaves_out_its_chain_and_bans_nobody() -> None:
    found = PeerAudit("p", 4, [], frozenset({"up", "down"}), fed_by=frozenset({"up", "down"}), withdrawn=True)
    out = judge(found, 1, set())
    assert set(out) == {"p", "up", "down"} and not any(r.ban for r in out.values())
    assert "withdrawn" in out["p"].reason and not checked(found)


def test_frames_that_convict_a_peer_whose_own_checksums_disowned_its_state_ban_nobody() -> None:
    out = judge(audit(Finding.CLEAN, Finding.FORWARD), 1, set(), off_state=True)
    assert set(out) == {"p", "up", "down"} and not any(r.ban for r in out.values())
    assert "disowned" in out["p"].reason


def test_a_peer_disowns_its_state_only_by_a_checksum_of_the_phases_start_round_that_differs() -> None:
    asked = []

    def anchor() -> str:
        asked.append(1)
        return "a" * 64

    assert disowned((4, "b" * 64), 5, anchor)  # published after round 4, the start of phase 5: not the anchor
    assert not disowned((4, "a" * 64), 5, anchor)  # the anchor's own: its frames are judged as they are
    assert not disowned((3, "b" * 64), 5, anchor) and not disowned((5, "b" * 64), 5, anchor)  # another round's
    assert not disowned(None, 5, anchor)
    assert len(asked) == 2  # the anchor's checksum is computed only for a record of the right round


def test_two_of_a_peers_last_four_audits_taking_its_work_back_ban_it_and_the_count_starts_again() -> None:
    w = Withdrawals()
    assert not w.audited("p", 10, True)  # once: an honest peer resynced under its phase
    assert not w.audited("q", 11, True)  # another peer's count is its own
    assert not w.audited("p", 10, True)  # the same round found twice counts once
    assert w.audited("p", 40, True)  # twice in its last four audits here, however many rounds apart: banned
    assert not w.audited("p", 41, True)  # the audits that banned it count no more
    assert not w.audited("p", 42, True)  # adjacent rounds are one incident: an honest resync takes back two
    assert w.audited("p", 43, True)  # a third round in a row is a second
    for r in (12, 13, 14):  # clean audits push q's one withdrawal out of its last four
        assert not w.audited("q", r, False)
    assert not w.audited("q", 15, True) and w.audited("q", 17, True)
    assert not w.audited("clean", 5, False) and "clean" not in w.seen  # a peer that never took work back


def test_withdrawals_remember_a_bounded_number_of_peers_the_least_recent_forgotten() -> None:
    w = Withdrawals()
    for i in range(MAX_WITHDRAWERS + 1):
        w.audited(f"p{i}", 5, True)
    assert len(w.seen) == MAX_WITHDRAWERS and "p0" not in w.seen
    assert not w.audited("p0", 7, True) and w.audited(f"p{MAX_WITHDRAWERS}", 7, True)


def test_work_that_could_not_be_checked_is_not_taken_on_any_stage() -> None:
    for nothing in (audit(), audit(Finding.INCONCLUSIVE, Finding.INCONCLUSIVE), audit(Finding.UNJUDGED)):
        for stage in (0, 1):  # stage 0 too: the token window it signs with its frames makes it recomputable
            out = judge(nothing, stage, set())
            assert set(out) == {"p"} and not out["p"].ban
    assert judge(audit(Finding.CLEAN, Finding.INCONCLUSIVE), 1, set()) == {}


def _both_ways(*pairs: tuple[str, str]) -> set[tuple[str, str]]:
    """A pipeline's exchanges: activations one way, gradients back, each listed by the peer that holds it."""
    return {*pairs, *((b, a) for a, b in pairs)}


def test_a_liar_taints_every_peer_its_frames_reached_through_the_chain_and_no_other_swarm() -> None:
    # a 5-stage swarm s0..s4 (s2 lies; s3 took over from s3old mid-phase) and a second swarm t0..t1
    exchanged = _both_ways(("s0", "s1"), ("s1", "s2"), ("s2", "s3"), ("s3", "s4"), ("s2", "s3old"), ("t0", "t1"))
    reached = chain_of({"s2"}, exchanged)  # s2 itself was not audited: its neighbours' transcripts name it
    assert reached == {p: "s2" for p in ("s0", "s1", "s3", "s3old", "s4")}
    assert chain_of(set(), exchanged) == {} and chain_of({"nobody"}, exchanged) == {}
    # two liars in one chain: nobody is reached through a liar as if it were honest, and no liar is "reached"
    both = chain_of({"s1", "s3"}, exchanged)
    assert set(both) == {"s0", "s2", "s3old", "s4"} and both["s0"] == "s1" and both["s4"] == "s3"


def test_a_liar_cannot_join_an_honest_peer_of_another_swarm_to_its_chain_by_naming_it() -> None:
    # s2's own transcript lists frames "from" t0 and t1 (it cannot make their transcripts list frames of its): the
    # claim is an exchange t -> s2, whose taint would flow to s2 only
    exchanged = _both_ways(("s1", "s2"), ("s2", "s3"), ("t0", "t1")) | {("t0", "s2"), ("t1", "s2")}
    assert chain_of({"s2"}, exchanged) == {"s1": "s2", "s3": "s2"}
    out = judge(audit(Finding.FORWARD, neighbours=("s1", "s3"), fed_by=("s1", "s3", "t0", "t1")), 2, set())
    assert set(out) == {"p", "s1", "s3"} and out["p"].ban and not out["s1"].ban
    # a peer that only sent the liar frames (the liar sent nothing back) computed nothing from it
    assert set(judge(audit(Finding.FORWARD, neighbours=("s3",), fed_by=("s1", "s3")), 2, set())) == {"p", "s3"}
    # an honest peer's work is tainted by what it received from an earlier liar, not by what it sent one
    assert set(judge(audit(Finding.CLEAN, neighbours=("liar", "down"), fed_by=("down",)), 2, {"liar"})) == set()


def test_the_neighbours_still_to_audit_are_those_not_audited_each_at_the_stage_it_announces() -> None:
    found = PeerAudit("p", 4, [], frozenset({"up", "down", "done"}), sides={"up": -1, "down": 1, "done": 1})
    announced = {"up": 0, "down": 2, "done": 2}.get
    assert unaudited_neighbours(found, 1, 3, {"p", "done"}, announced) == ([("down", 2), ("up", 0)], set())
    # no stage outside the pipeline: the last stage's "downstream" and the driver's "upstream" do not exist
    assert unaudited_neighbours(found, 2, 3, {"p", "done"}, announced) == ([], {"up", "down"})
    # a neighbour whose own announcement names another stage than its side says (a liar naming an honest peer of
    # another stage), or none, is not audited: it cannot be placed
    assert unaudited_neighbours(found, 1, 3, {"p", "done"}, {"up": 0, "down": 0}.get) == ([("up", 0)], {"down"})


def test_whether_an_audit_cleared_a_peer_is_a_clean_sample_of_its_first_step() -> None:
    assert checked(audit(Finding.CLEAN, Finding.INCONCLUSIVE))
    assert not checked(audit()) and not checked(audit(Finding.INCONCLUSIVE))
    later = PeerAudit("p", 4, [Verdict("p", 4, (1, 9, 0, 0), AuditResult(Finding.CLEAN, 2, CLOSE, CLOSE))],
                      frozenset())
    assert not checked(later)  # a later step's siblings agreeing is not the exact check of the first step
