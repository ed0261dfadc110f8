"""The round protocol's pure decisions about state: checksums, whose votes count and when a verdict is in, and
when a resumed peer waits before it trusts its checkpoint."""

import torch

from hlbp.peer.rounds.rules import (
    behind_members,
    checkpoint_ahead,
    checks_settled,
    majority_checksums,
    result_pending,
    result_unpublished,
)
from hlbp.peer.rounds.statesync import shard_checksum
from hlbp.protocol.roundwire import AcceptedSet, ShardChecks

PEERS = [f"12D3KooWpeer{i:02d}xxxxxxxxxxxxxxxx" for i in range(6)]


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
