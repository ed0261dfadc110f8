"""The round protocol's pure decisions: ranking, windows, which accepted set wins, majorities, checksums."""

import torch

from hlbp.peer.rounds.rules import (
    adapt_window,
    behind_members,
    checkpoint_ahead,
    checks_settled,
    coordinator_order,
    coordinator_ranking,
    dropped_named,
    holds_up,
    majority_checksums,
    pick_accepted,
    result_pending,
    result_unpublished,
    widen_for_late,
)
from hlbp.peer.rounds.statesync import shard_checksum
from hlbp.protocol.roundwire import AcceptedSet, ShardChecks

PEERS = [f"12D3KooWpeer{i:02d}xxxxxxxxxxxxxxxx" for i in range(6)]


def test_coordinator_order_is_the_same_from_any_view_and_changes_by_round():
    a = coordinator_order(7, PEERS)
    assert a == coordinator_order(7, list(reversed(PEERS))) == coordinator_order(7, PEERS + PEERS[:2])
    assert sorted(a) == sorted(PEERS)
    firsts = {coordinator_order(r, PEERS)[0] for r in range(40)}
    assert len(firsts) >= 4  # the duty rotates; no peer is a fixed server


def test_only_the_head_of_the_agreed_order_holds_a_round_up_and_only_half_a_window_after_the_first_notice():
    prior = {p: frozenset({0, 1}) for p in PEERS[:4]}
    head, second = coordinator_ranking(5, prior, 2)[:2]

    def held(me: str, now: float, lead: tuple[str, ...] = (), first: float | None = 100.0) -> bool:
        return holds_up(me, 5, prior, 2, frozenset(), lead, first, now, window=6.0)

    assert not held(head, 1000.0, first=None)  # nobody announced the round yet
    assert not held(head, 102.9) and held(head, 103.0)  # half the 6 s window after the first notice
    assert not held(second, 1000.0)  # the round closes without a later peer: it holds nothing up
    assert held(second, 103.0, lead=(second, head)) and not held(head, 103.0, lead=(second, head))  # a committee
    # a peer the head's ranking puts behind others because it holds fewer shards is never first
    assert not holds_up(PEERS[5], 5, {**prior, PEERS[5]: frozenset({0})}, 2, frozenset(), (), 100.0, 1000.0, 6.0)


def test_adapt_window_follows_arrivals_within_bounds():
    assert adapt_window([0.0, 2.0], lo=1.0, hi=10.0, current=5.0) == 4.0
    assert adapt_window([0.0, 100.0], lo=1.0, hi=10.0, current=5.0) == 10.0
    assert adapt_window([0.0, 0.0], lo=2.0, hi=10.0, current=2.5) == 2.0
    assert adapt_window([0.0], lo=1.0, hi=10.0, current=5.0) == 5.0  # one arrival says nothing about spread


def test_adapt_window_grows_at_once_and_shrinks_by_a_quarter_a_round():
    window, seen = 8.0, []
    for _ in range(8):  # rounds in lockstep: the window steps down to the floor, never straight to it
        window = adapt_window([0.0, 0.1], lo=1.0, hi=30.0, current=window)
        seen.append(window)
    assert seen[:3] == [6.0, 4.5, 3.375] and seen[-1] == 1.15
    assert adapt_window([0.0, 6.0], lo=1.0, hi=30.0, current=1.15) == 10.0  # one slow round: wide at once


def test_widen_for_late_takes_back_a_near_miss_and_leaves_a_straggler_out():
    # closed after a 2 s window; the next one had shrunk to 1.5 s
    assert widen_for_late(1.5, 2.0, [2.6], hi=30.0) == 1.5 * 2.6 + 1.0  # missed by 0.6 s: the next window takes it
    assert widen_for_late(1.5, 2.0, [4.0], hi=30.0) == 7.0  # one window late still counts
    assert widen_for_late(1.5, 2.0, [4.1, 20.0], hi=30.0) == 1.5  # later than that: a straggler, never waited for
    assert widen_for_late(1.5, 2.0, [3.9], hi=5.0) == 5.0  # within the manifest's bound
    assert widen_for_late(9.0, 2.0, [2.5], hi=30.0) == 9.0  # never narrows
    assert widen_for_late(1.5, 2.0, [-1.0], hi=30.0) == 1.5  # a clock that ran backwards is no evidence


def test_pick_accepted_prefers_the_best_ranked_coordinator():
    order = coordinator_order(3, PEERS)
    sets = [AcceptedSet(order[2], 3, ()), AcceptedSet(order[1], 3, ())]
    assert pick_accepted(sets, order).coordinator == order[1]
    assert pick_accepted([], order) is None


def test_majority_checksums_per_shard_and_round():
    checks = [
        ShardChecks(PEERS[0], 4, {0: "a" * 64, 1: "b" * 64}),
        ShardChecks(PEERS[1], 4, {0: "a" * 64, 1: "c" * 64}),
        ShardChecks(PEERS[2], 4, {0: "d" * 64, 1: "c" * 64}),
        ShardChecks(PEERS[3], 3, {0: "e" * 64, 1: "e" * 64}),  # an older round does not vote
    ]
    assert majority_checksums(checks, 4) == {0: "a" * 64, 1: "c" * 64}


def test_shard_checksum_sees_every_bit():
    params = {"a": torch.zeros(3, 4), "b": torch.ones(5)}
    ref = shard_checksum(params, ["a", "b"])
    assert ref == shard_checksum({"b": torch.ones(5), "a": torch.zeros(3, 4)}, ["b", "a"])
    params["a"][1, 2] = 1e-30
    assert shard_checksum(params, ["a", "b"]) != ref


def test_close_verdict_waits_for_the_minimum_then_closes_empty() -> None:
    from hlbp.peer.rounds.rules import Verdict, close_verdict

    assert close_verdict(3, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.MEMBERS
    assert close_verdict(2, 3, now=5.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.WAIT
    assert close_verdict(2, 3, now=60.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.EMPTY
    # a lower-ranked coordinator gives the better-ranked ones their takeover time first
    assert close_verdict(2, 3, now=62.0, first_seen=0.0, max_window=60.0, rank=1, takeover_s=3.0) is Verdict.WAIT
    assert close_verdict(0, 1, now=0.0, first_seen=0.0, max_window=60.0, rank=0, takeover_s=3.0) is Verdict.WAIT


def test_round_standing_for_status() -> None:
    from hlbp.peer.rounds.rules import round_standing

    a, b = "a" * 64, "b" * 64
    sparse = [ShardChecks("p1", 5, {0: a}), ShardChecks("p2", 5, {0: a}), ShardChecks("p3", 5, {0: b}),
              ShardChecks("p4", 4, {0: a})]
    got = round_standing(sparse)
    assert got["p1"] == {"round": 5, "agrees": True} and got["p2"]["agrees"]
    assert not got["p3"]["agrees"] and got["p4"] == {"round": 4, "agrees": False}  # out of sync / behind
    dense = [ShardChecks("p1", 2, {0: a}, {0: (1.0, 5.0)}), ShardChecks("p2", 2, {0: b}, {0: (1.0 + 1e-9, 5.0)}),
             ShardChecks("p3", 2, {0: b}, {0: (2.0, 5.0)})]
    assert [round_standing(dense)[p]["agrees"] for p in ("p1", "p2", "p3")] == [True, True, False]
    assert round_standing([]) == {}


def test_coordinators_that_contributed_every_shard_rank_before_stage_peers() -> None:
    from hlbp.peer.rounds.rules import coordinator_ranking

    shards = {"stage-a": {1}, "full-b": {0, 1}, "stage-c": {0}, "full-d": {0, 1}}
    order = coordinator_ranking(7, shards, 2)
    assert order[:2] == coordinator_order(7, ["full-b", "full-d"])
    assert order[2:] == coordinator_order(7, ["stage-a", "stage-c"])
    assert coordinator_ranking(7, {"stage-a": {1}, "stage-c": {0}}, 2) == coordinator_order(7, ["stage-a", "stage-c"])


def test_contributors_behind_nat_coordinate_after_the_dialable_ones_of_their_group() -> None:
    from hlbp.peer.rounds.rules import coordinator_ranking, round_members

    shards = {"nat-a": {0, 1}, "pub-b": {0, 1}, "nat-c": {0, 1}, "pub-d": {0, 1}, "stage-e": {0}}
    order = coordinator_ranking(3, shards, 2, undialable={"nat-a", "nat-c"})
    assert order == [*coordinator_order(3, ["pub-b", "pub-d"]), *coordinator_order(3, ["nat-a", "nat-c"]), "stage-e"]
    # only peers behind NAT contributed: one of them still coordinates
    assert coordinator_ranking(3, {"nat-a": {0, 1}}, 2, undialable={"nat-a"}) == ["nat-a"]
    # the members follow the same ranking: a NATed coordinator's set loses to a dialable one's
    sets = [AcceptedSet(p, 3, ((p, 1, {0: "d"}),)) for p in ("nat-a", "pub-b")]
    assert round_members(3, shards, sets, 2, undialable={"nat-a", "nat-c"}) == frozenset({"pub-b"})


def test_round_standing_counts_a_stage_peer_that_agrees_on_its_one_shard() -> None:
    checks = [ShardChecks("full-1", 3, {0: "a", 1: "b"}), ShardChecks("full-2", 3, {0: "a", 1: "b"}),
              ShardChecks("stage-1", 3, {1: "b"}), ShardChecks("stage-0", 3, {0: "x"})]
    from hlbp.peer.rounds.rules import round_standing

    standing = round_standing(checks)
    assert standing["stage-1"]["agrees"] and standing["full-1"]["agrees"]
    assert not standing["stage-0"]["agrees"]


def _checks(peer: int, digests: dict[int, str], r: int = 3) -> ShardChecks:
    return ShardChecks(PEERS[peer], r, {s: d * 64 for s, d in digests.items()})


def test_checks_settled_when_every_online_member_published():
    mine = _checks(0, {0: "a", 1: "b"})
    members = dict.fromkeys(PEERS[:4])  # full replicas: every shard
    published = [_checks(1, {0: "a", 1: "b"}), _checks(2, {0: "x", 1: "y"})]
    assert not checks_settled(published, mine, members)  # 2 against 1 with one to come: not decided
    assert checks_settled([*published, _checks(3, {0: "x", 1: "y"})], mine, members)  # all in
    # the member still to come is no longer announced online: nothing more will arrive
    assert checks_settled(published, mine, members, online=set(PEERS[1:3]))
    assert not checks_settled(published, mine, members, online=set(PEERS[1:4]))
    # a record of another round, or our own record read back, is not a member's answer
    assert not checks_settled([*published, _checks(3, {0: "a", 1: "b"}, r=2), _checks(0, {0: "a", 1: "b"})],
                              mine, members)
    # the member still to come already published a later round's record (which replaced its round-3 one, so a
    # verifier a round behind would wait for it in vain): nothing more will arrive for round 3
    assert checks_settled(published, mine, members, moved_on={PEERS[3]})
    assert not checks_settled(published, mine, members, moved_on={PEERS[4]})  # not a member: still waiting


def test_checks_settled_by_a_majority_the_rest_cannot_overturn():
    members = dict.fromkeys(PEERS[:5])
    mine = _checks(0, {0: "a"})
    # 3 of 5 agree, 2 to come: 3 > 0 + 2, so ours is the majority whatever they publish
    assert checks_settled([_checks(1, {0: "a"}), _checks(2, {0: "a"})], mine, members)
    # 2 of 5 agree, 3 to come: they could outvote us
    assert not checks_settled([_checks(1, {0: "a"})], mine, members)
    # we differ from a decided majority: settled too, and the majority says we are out of sync
    odd = _checks(0, {0: "z"})
    seen = [_checks(i, {0: "a"}) for i in (1, 2, 3)]
    assert checks_settled(seen, odd, members)  # 3 > 1 + 1
    assert majority_checksums([*seen, odd], 3)[0] == "a" * 64
    # a tie that the last member would break keeps waiting
    assert not checks_settled([_checks(1, {0: "a"}), _checks(2, {0: "b"}), _checks(3, {0: "b"})], mine, members)


def test_checks_settled_counts_only_the_members_that_hold_the_shard():
    mine = _checks(0, {1: "s"})  # a stage peer of shard 1
    members = {PEERS[0]: {1}, PEERS[1]: {1}, PEERS[2]: {0}, PEERS[3]: {0}, PEERS[4]: {0}}
    # shard-0 peers never publish shard 1: both shard-1 holders agreeing decides it, whatever shard 0 still owes
    assert not checks_settled([], mine, members)
    assert not checks_settled([_checks(2, {0: "q"})], mine, members)
    assert checks_settled([_checks(1, {1: "s"}), _checks(2, {0: "q"})], mine, members)


def test_checks_settled_waits_for_everyone_in_a_dense_run():
    members = dict.fromkeys(PEERS[:4])
    mine = ShardChecks(PEERS[0], 3, {0: "a" * 64}, {0: (1.0, 2.0)})
    seen = [ShardChecks(PEERS[i], 3, {0: "a" * 64}, {0: (1.0, 2.0)}) for i in (1, 2)]
    assert not checks_settled(seen, mine, members)  # fingerprints agree only up to rounding: no early verdict
    assert checks_settled(seen, mine, members, online=set(PEERS[1:3]))


def test_only_a_rounds_members_vote_on_its_state() -> None:
    from hlbp.peer.rounds.rules import checks_settled, majority_checksums, member_checks, round_members
    from hlbp.protocol.roundwire import AcceptedSet

    good, bad = "a" * 64, "b" * 64
    honest = [ShardChecks(p, 5, {0: good}) for p in ("h1", "h2")]
    throwaway = [ShardChecks(f"sybil{i}", 5, {0: bad}) for i in range(10)]
    assert majority_checksums([*honest, *throwaway], 5)[0] == bad  # counted as before: the keys outvote the run
    members = {"h1", "h2", "me"}
    assert majority_checksums(member_checks([*honest, *throwaway], 5, members), 5)[0] == good
    mine = ShardChecks("me", 5, {0: good})
    # the verdict is settled by the members' records alone, and the throwaway votes cannot unsettle it
    assert checks_settled([*honest, *throwaway], mine, dict.fromkeys(members))
    assert not checks_settled(throwaway, mine, dict.fromkeys(members))  # members still to publish: keep waiting

    notices = {"h1": {0}, "h2": {0}, "me": {0}}
    sets = [AcceptedSet("sybil0", 5, (("sybil0", 1, {0: "c" * 64}),)),  # a key that contributed nothing
            *(AcceptedSet(p, 5, tuple((m, 1, {0: "d" * 64}) for m in sorted(notices))) for p in notices)]
    assert round_members(5, notices, sets, 1) == frozenset(notices)
    assert round_members(5, notices, sets[:1], 1) is None  # only a stranger's set: the members are unknown
    from hlbp.peer.rounds.rules import round_member_shards

    # the shards each member voted on come from the set, so a reader that lacks a member's notice still counts it
    assert round_member_shards(5, notices, sets, 1) == dict.fromkeys(notices, frozenset({0}))


def test_full_replicas_outvote_stage_peers_on_the_shards_they_hold_and_nobody_votes_on_what_it_did_not_send() -> None:
    from hlbp.peer.rounds.agreement import ExactAgreement
    from hlbp.peer.rounds.rules import majority_checksums, vote_checks

    good, bad = "a" * 64, "b" * 64
    full = [ShardChecks(p, 5, {0: good, 1: good}) for p in ("f1", "f2")]
    # three stage peers of shard 1 and one of shard 0 agree on a poisoned shard 1, and sign shard 0 too
    stage = [ShardChecks(p, 5, {0: bad, 1: bad}) for p in ("s1", "s2", "s3", "s0")]
    members = {"f1": None, "f2": None, "s1": {1}, "s2": {1}, "s3": {1}, "s0": {0}}
    assert majority_checksums([*full, *stage], 5) == {0: bad, 1: bad}  # one vote each: the stage peers win
    votes = vote_checks([*full, *stage], 5, members, 2)
    assert votes.whole == {"f1", "f2"}
    assert majority_checksums(votes.checks, 5, votes.whole) == {0: good, 1: good}
    # each votes only on the shard it contributed
    assert {c.peer: c.checksums for c in votes.checks if c.peer.startswith("s")} == {
        "s1": {1: bad}, "s2": {1: bad}, "s3": {1: bad}, "s0": {0: bad}}
    # a state sync fetches each shard from the peers whose vote matches the agreed checksum: the full replicas
    donors, expect = ExactAgreement().agreed(votes.checks, 5, [1], 2, votes.whole) or ([], {})
    assert sorted(donors) == ["f1", "f2"] and expect["f1"] == {1: good}
    # without a full replica in the round, stage peers vote, each on the shard it contributed only
    alone = vote_checks(stage, 5, {p: members[p] for p in ("s1", "s2", "s3", "s0")}, 2)
    assert alone.whole == frozenset()
    assert majority_checksums(alone.checks, 5, alone.whole) == {0: bad, 1: bad}
    # a stage peer's own vote cannot tie a full replica's (a tie of equal votes goes to the smaller checksum, here
    # the stage peer's)
    small = "0" * 64
    mine = ShardChecks("s1", 5, {1: small})
    assert ExactAgreement().agrees([full[0]], mine)  # one vote each, counted alike: the tie made it the agreed one
    one_full = vote_checks([full[0], mine], 5, {"f1": None, "s1": {1}}, 2)
    vote = next((c for c in one_full.checks if c.peer == "s1"), ShardChecks("s1", 5, {}))
    assert not ExactAgreement().agrees([c for c in one_full.checks if c.peer != "s1"], mine, vote, one_full.whole)


def test_stage_peers_break_a_tie_between_full_replicas_the_same_way_for_every_reader() -> None:
    """Two full replicas that disagree (one restarted from an older state) tie; the stage peers that contributed
    the shard decide between their states, so both replicas reach the same verdict whatever the checksums' order
    (a tie that went to the smaller string let each side of a split keep its own state)."""
    from hlbp.peer.rounds.agreement import ExactAgreement
    from hlbp.peer.rounds.rules import majority_checksums, vote_checks

    for right, wrong in (("a" * 64, "f" * 64), ("f" * 64, "a" * 64)):
        records = [ShardChecks("f1", 6, {0: right, 1: right}), ShardChecks("f2", 6, {0: wrong, 1: wrong}),
                   ShardChecks("s0", 6, {0: right}), ShardChecks("s1", 6, {1: right})]
        members = {"f1": None, "f2": None, "s0": {0}, "s1": {1}}
        votes = vote_checks(records, 6, members, 2)
        assert majority_checksums(votes.checks, 6, votes.whole) == {0: right, 1: right}
        for me in ("f1", "f2"):
            mine = next(c for c in votes.checks if c.peer == me)
            others = [c for c in votes.checks if c.peer != me]
            assert ExactAgreement().agrees(others, mine, mine, votes.whole) == (me == "f1"), (me, right)
        # yet no number of stage peers outvotes a full replica that outnumbers the others
        many = [ShardChecks(f"s{i}", 6, {1: wrong}) for i in range(2, 9)]
        votes = vote_checks([*records, ShardChecks("f3", 6, {0: right, 1: right}), *many], 6,
                            {**members, "f3": None, **{c.peer: {1} for c in many}}, 2)
        assert majority_checksums(votes.checks, 6, votes.whole)[1] == right


def test_checks_settled_ranks_votes_as_the_verdict_does() -> None:
    """With ``n_shards`` a full replica's pending vote can overturn any number of stage peers' votes, and a stage
    peer's vote on a shard it did not contribute counts for nothing."""
    a, b = "a" * 64, "b" * 64
    members = {"f1": None, "f2": None, "f3": None, "s1": {1}, "s2": {1}, "s3": {1}}
    mine = ShardChecks("f1", 4, {1: a})  # the shard in question
    seen = [ShardChecks(p, 4, {1: a}) for p in ("s1", "s2", "s3")]
    assert checks_settled(seen, mine, members)  # counted alike: 4 against a pending 2
    assert not checks_settled(seen, mine, members, n_shards=2)  # f2 and f3 together would outrank us
    assert checks_settled([*seen, ShardChecks("f2", 4, {0: a, 1: a})], mine, members, n_shards=2)
    members = {"f1": None, "f2": None, "s1": {1}, "s2": {1}, "s3": {1}}
    assert checks_settled(seen, mine, members, n_shards=2)  # f2 alone would tie the full votes, and lose the tie
    # f2 disagrees: 1 full vote each, the stage peers break the tie for us; nobody is left to publish
    split = [*seen, ShardChecks("f2", 4, {0: b, 1: b})]
    assert checks_settled(split, mine, members, n_shards=2)
    # a stage peer that signs shard 0, which it did not contribute, counts for nothing there
    mine = ShardChecks("f1", 4, {0: a, 1: a})
    members3 = {"f1": None, "f2": None, "f3": None, "s1": {1}}
    lying = [ShardChecks("f2", 4, {0: a, 1: a}), ShardChecks("s1", 4, {0: b, 1: a})]
    assert checks_settled(lying, mine, members3, n_shards=2)  # 2 full votes against a pending 1: decided
    tie = [ShardChecks("f2", 4, {0: b, 1: b})]
    assert not checks_settled(tie, mine, members3, n_shards=2)  # 1 to 1 with f3 to come


def test_last_rounds_members_rank_first_whoever_announced_first() -> None:
    from hlbp.peer.rounds.rules import turn_order

    prior = {"m1": {0, 1}, "m2": {0, 1}, "stage": {1}}
    notices = {"newcomer": {0, 1}, "m2": {0, 1}}  # m1 has not announced yet; a newcomer was quick
    order = turn_order(7, prior, notices, 2)
    assert order[:2] == coordinator_order(7, ["m1", "m2"]) and order[2:] == ["stage", "newcomer"]
    assert turn_order(7, {}, notices, 2) == coordinator_order(7, ["newcomer", "m2"])  # no agreed order yet


def test_a_set_counts_only_once_its_publishers_turn_has_come() -> None:
    from hlbp.peer.rounds.rules import set_counts

    order = ["first", "second", "third"]
    members = (("first", 10, {0: "a" * 64}), ("second", 10, {0: "b" * 64}))

    def counts(coordinator: str, now: float, with_members: bool = True, prior_known: bool = True,
               complete: bool = False, first_seen: float | None = 100.0, min_contributors: int = 1) -> bool:
        s = AcceptedSet(coordinator, 7, members if with_members else ())
        return set_counts(s, order, prior_known=prior_known, complete=complete, first_seen=first_seen, now=now,
                          window=4.0, max_window=30.0, takeover_s=3.0, min_contributors=min_contributors)

    assert counts("first", 100.1)  # the agreed head closes at once
    assert counts("first", 100.1, prior_known=False, complete=True)  # or once every expected contributor announced
    assert not counts("first", 103.9, prior_known=False) and counts("first", 104.0, prior_known=False)
    assert not counts("second", 106.9) and counts("second", 107.0)  # a takeover counts once it is due here
    assert not counts("third", 109.9) and counts("third", 110.0)
    assert not counts("stranger", 1e9)  # a key that is no member and contributed nothing never closes a round
    assert not counts("first", 129.9, with_members=False) and counts("first", 130.0, with_members=False)
    assert not counts("second", 132.9, with_members=False) and counts("second", 133.0, with_members=False)
    assert not counts("second", 1e9, first_seen=None)  # no notice seen: no takeover is due
    assert not counts("first", 1e9, min_contributors=3)  # fewer members than the run requires never count


def test_members_behind_nat_take_their_turn_after_the_dialable_members() -> None:
    from hlbp.peer.rounds.rules import turn_order

    prior = {"m1": {0, 1}, "m2": {0, 1}, "m3": {0, 1}}
    order = turn_order(7, prior, {"new": {0, 1}}, 2, undialable={"m1", "new"})
    assert order[:2] == coordinator_order(7, ["m2", "m3"]) and order[2:] == ["m1", "new"]


def test_a_round_is_complete_only_with_the_expected_contributors() -> None:
    from hlbp.peer.rounds.rules import UNKNOWN, Expected, complete

    expected = Expected(3, frozenset({"a", "b", "c"}))
    fakes = {f"fake{i}": None for i in range(40)}
    assert not complete({"a": None, **fakes}, expected)  # 40 notices under throwaway keys complete nothing
    assert not complete({"a", "b"}, expected)
    assert complete({"a", "b", "c", "fake1"}, expected)
    assert not complete({"a", "c"}, expected, banned=lambda p: p == "c")  # a banned sender's notice counts nothing
    assert complete({"a", "b"}, expected, banned=lambda p: p == "c")  # ... and a banned peer is not waited for
    assert not complete(set(), expected, banned=lambda p: True)  # every expected peer banned: one notice still needed
    assert complete({"a", "b", "c"}, Expected(2, frozenset({"a", "b", "c"})), banned=lambda p: p == "c")
    assert complete({"x", "y"}, Expected(2))  # only a count known (the in-process engine): any notice counts
    assert not complete({"a", "b", "c"}, UNKNOWN)  # announcements unread: the window runs out instead


def test_the_expected_contributors_are_full_replicas_and_whole_swarms() -> None:
    from dataclasses import dataclass

    from hlbp.peer.node.replica import expected_contributors

    @dataclass
    class Ann:
        role: str
        online: bool = True
        swarm: int | None = None
        stage: int | None = None

    @dataclass
    class Run:
        stages: tuple[tuple[int, int], ...] = ((0, 1), (1, 2))

        def may_contribute(self, peer: str) -> bool:
            return peer != "outsider"

    anns = {"r1": Ann("replica"), "r2": Ann("replica"), "gone": Ann("replica", online=False),
            "outsider": Ann("replica"), "s0": Ann("stage", swarm=1, stage=0), "s1": Ann("stage", swarm=1, stage=1),
            "standby": Ann("stage", swarm=1, stage=1), "half": Ann("stage", swarm=2, stage=0)}
    got = expected_contributors(anns, Run())
    assert got.count == 2 + 2  # two replicas, one per stage of the whole swarm (its standby trains nothing)
    assert got.peers == frozenset({"r1", "r2", "s0", "s1", "standby"})
    # which shards each applies, for the payload fetch trees: a full replica every one, a stage peer its stage's
    assert got.shards == {"r1": {0, 1}, "r2": {0, 1}, "s0": {0}, "s1": {1}, "standby": {1}}
    assert sorted(map(sorted, got.slots)) == [["r1"], ["r2"], ["s0"], ["s1", "standby"]]


def test_a_banned_stage_peer_whose_stage_another_peer_serves_is_still_waited_for_by_its_stage() -> None:
    from hlbp.peer.rounds.rules import Expected, complete

    # a full replica and a 3-stage swarm whose stage-1 liar was banned and replaced by a standby
    slots = (frozenset({"r"}), frozenset({"d"}), frozenset({"liar", "standby"}), frozenset({"last"}))
    expected = Expected(4, frozenset().union(*slots), None, slots)
    banned = {"liar"}.__contains__
    assert not complete({"r", "standby", "last"}, expected, banned)  # the driver, which sends last, is awaited
    assert complete({"r", "d", "standby", "last"}, expected, banned)
    # a stage no unbanned peer serves is not waited for (the swarm cannot send it)
    alone = (frozenset({"r"}), frozenset({"d"}), frozenset({"liar"}), frozenset({"last"}))
    assert complete({"r", "d", "last"}, Expected(4, frozenset().union(*alone), None, alone), banned)


def test_unannounced_keys_rank_behind_every_announced_contributor() -> None:
    from hlbp.peer.rounds.rules import turn_order

    notices = {p: {0, 1} for p in ("a", "b", "c", *(f"fake{i}" for i in range(40)))}
    order = turn_order(0, {}, notices, 2, announced={"a", "b", "c"})
    assert order[:3] == coordinator_order(0, ["a", "b", "c"])  # whoever reads the 40 fakes, the head is the same
    assert order[:3] == turn_order(0, {}, {p: {0, 1} for p in "abc"}, 2, announced={"a", "b", "c"})
    # members of the previous round still come first
    assert turn_order(1, {"fake3": {0, 1}}, notices, 2, announced={"a", "b", "c"})[0] == "fake3"


def test_a_resumed_peer_waits_for_the_members_of_its_round_that_published_nothing_as_new() -> None:
    """Members of round 4 whose latest checksums are of round 3 (restarting from an older checkpoint), or who have
    none (not up yet), are waited for; one at round 4 or later, and the peer itself, are not."""
    checks = [ShardChecks("a", 3, {0: "a" * 64}), ShardChecks("b", 4, {0: "a" * 64}),
              ShardChecks("c", 6, {0: "a" * 64}), ShardChecks("me", 2, {0: "a" * 64})]
    assert behind_members({"a", "b", "c", "d", "me"}, checks, 4, "me") == {"a", "d"}
    assert behind_members({"b", "c", "me"}, checks, 4, "me") == set()
    assert behind_members(set(), checks, 4, "me") == set()


def test_a_checkpoint_newer_than_the_members_latest_agreed_round_is_kept() -> None:
    """A checkpoint whose next round is 5 holds round 4's state: it is current against an agreed round 4, ahead of
    an agreed round 2 or 3 (the others came back from older checkpoints: they sync from it, never it from them),
    and behind an agreed round 5 or later (it syncs)."""
    assert not checkpoint_ahead(5, 4)
    assert checkpoint_ahead(5, 3) and checkpoint_ahead(5, 2)
    assert not checkpoint_ahead(5, 5) and not checkpoint_ahead(5, 9)
    assert not checkpoint_ahead(0, 0)  # a fresh peer is never ahead


def test_a_closed_rounds_result_is_unpublished_until_one_of_its_other_members_publishes_it() -> None:
    """Round 6 closed with c and d as members. Before either publishes a state of round 6 or later (their records
    are of round 5, from before they stopped), a starting peer waits; once one of them does, it takes that. A round
    with no member but the peer itself, or no known member, is not waited for."""
    before = [ShardChecks("c", 5, {0: "a" * 64}), ShardChecks("d", 5, {0: "a" * 64})]
    assert result_unpublished({"c", "d"}, before, 6, "me")
    assert result_unpublished({"c", "d"}, before[:1], 6, "me")  # d has published nothing at all yet
    after = [ShardChecks("c", 6, {0: "b" * 64}), ShardChecks("d", 5, {0: "a" * 64})]
    assert not result_unpublished({"c", "d"}, after, 6, "me")
    assert not result_unpublished({"c", "d"}, [ShardChecks("c", 9, {0: "b" * 64})], 6, "me")  # a later round's
    assert not result_unpublished({"me"}, before, 6, "me") and not result_unpublished(set(), before, 6, "me")
    assert result_unpublished({"c", "me"}, before, 6, "me")  # the peer's own membership waits for nothing of its own


def test_a_checkpoint_one_round_past_the_agreed_state_waits_while_that_rounds_members_are_closing_it() -> None:
    """The members agreed on round 1; our checkpoint holds round 2 (next round 3) and peers of round 1 announced
    contributions to round 2: they are closing it, so we wait for their result. Not when the checkpoint is the
    agreed state's successor (next round 2: nothing of ours is unconfirmed), when it is further ahead (the others came
    back from older checkpoints and sync from ours), or when nobody but us is closing the round."""
    assert result_pending(3, 1, {"a", "b"}, "me")
    assert result_pending(3, 1, {"a", "me"}, "me")
    assert not result_pending(2, 1, {"a", "b"}, "me")
    assert not result_pending(4, 1, {"a", "b"}, "me")
    assert not result_pending(3, 2, {"a", "b"}, "me")  # they published round 2: compare, do not wait
    assert not result_pending(3, 1, {"me"}, "me") and not result_pending(3, 1, set(), "me")


def test_a_set_names_as_dropped_only_non_members_sorted_and_no_more_than_its_members_leave_room_for() -> None:
    assert dropped_named({"c", "a", "m"}, {"m"}, 256) == ("a", "c")  # a member is never named dropped
    assert dropped_named({"c", "b", "a"}, {"m", "n"}, 4) == ("a", "b")  # 2 members leave room for 2 of 4 ids
    assert dropped_named({"a"}, {f"p{i}" for i in range(5)}, 4) == ()  # no room: nobody named, the set stays readable
