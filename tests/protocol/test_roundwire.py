"""Round records: signed, bound to run and round, and any bytes either parse or raise ProtocolError."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_CHECKS,
    KIND_CONTRIB,
    MAX_MEMBERS,
    AcceptedSet,
    ContribNotice,
    ShardChecks,
    parse_accepted,
    parse_checks,
    parse_contrib,
    sign,
)

ME, OTHER = Identity.generate(), Identity.generate()
D = "ab" * 32


def test_round_trips():
    n = ContribNotice(ME.peer_id, 5, 1234, {0: D, 1: D}, {0: 10, 1: 20})
    assert parse_contrib(sign(KIND_CONTRIB, n.to_body("run"), ME), ME.peer_id, "run", 5) == n
    a = AcceptedSet(ME.peer_id, 5, tuple(sorted([(ME.peer_id, 1, {0: D}), (OTHER.peer_id, 2, {0: D})])))
    assert parse_accepted(sign(KIND_ACCEPTED, a.to_body("run"), ME), ME.peer_id, "run", 5) == a
    c = ShardChecks(ME.peer_id, 5, {0: D})
    assert parse_checks(sign(KIND_CHECKS, c.to_body("run"), ME), ME.peer_id, "run") == c


def test_checks_carry_the_round_before_and_vote_on_it_for_a_late_reader():
    c = ShardChecks(ME.peer_id, 6, {0: D, 1: D}, previous={0: "cd" * 32, 1: D})
    parsed = parse_checks(sign(KIND_CHECKS, c.to_body("run"), ME), ME.peer_id, "run")
    assert parsed == c
    assert parsed.as_of(6) is parsed
    assert parsed.as_of(5) == ShardChecks(ME.peer_id, 5, {0: "cd" * 32, 1: D})
    assert parsed.as_of(4) is None and parsed.as_of(7) is None
    plain = ShardChecks(ME.peer_id, 6, {0: D})
    assert "previous" not in plain.to_body("run")  # the bytes an older peer signs and expects
    assert plain.as_of(5) is None  # a record without the round before votes on its own round only


@pytest.mark.parametrize(("previous", "round_", "match"), [
    ({"0": "zz" * 32}, 6, "previous checksums: shard 0 digest is not 64 hex digits"),
    ({"01": D}, 6, "previous checksums: bad shard index"),
    ([D], 6, "previous checksums must map at most 256 shards"),
    ({str(i): D for i in range(257)}, 6, "previous checksums"),
    ({"0": D}, 0, "checks of round 0 cannot carry a previous round's"),
])
def test_malformed_previous_checksums_are_refused(previous, round_, match):
    body = {"run": "run", "round": round_, "checksums": {"0": D}, "previous": previous}
    with pytest.raises(ProtocolError, match=match):
        parse_checks(sign(KIND_CHECKS, body, ME), ME.peer_id, "run")


def test_a_notice_says_when_its_sender_cannot_be_dialled_and_a_dialable_one_is_unchanged():
    behind_nat = ContribNotice(ME.peer_id, 5, 1, {0: D}, {0: 10}, dialable=False)
    assert parse_contrib(sign(KIND_CONTRIB, behind_nat.to_body("run"), ME), ME.peer_id, "run", 5) == behind_nat
    public = ContribNotice(ME.peer_id, 5, 1, {0: D}, {0: 10})
    assert "dialable" not in public.to_body("run")  # the same bytes an older peer signs and expects
    assert parse_contrib(sign(KIND_CONTRIB, public.to_body("run"), ME), ME.peer_id, "run", 5).dialable


@pytest.mark.parametrize(
    "call",
    [
        # stored under another peer's id: a forgery
        lambda data: parse_contrib(data, OTHER.peer_id, "run", 5),
        # replayed into another round or run
        lambda data: parse_contrib(data, ME.peer_id, "run", 6),
        lambda data: parse_contrib(data, ME.peer_id, "other-run", 5),
        # a contribution notice is not an accepted set
        lambda data: parse_accepted(data, ME.peer_id, "run", 5),
    ],
)
def test_forged_replayed_or_mistyped_records_are_refused(call):
    data = sign(KIND_CONTRIB, ContribNotice(ME.peer_id, 5, 1, {0: D}, {0: 1}).to_body("run"), ME)
    with pytest.raises(ProtocolError):
        call(data)


@pytest.mark.parametrize(
    "body",
    [
        {"run": "run", "round": 1, "tokens": -1, "digests": {"0": D}, "sizes": {"0": 1}},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"0": "zz"}, "sizes": {"0": 1}},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"999": D}, "sizes": {"999": 1}},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"0": D}, "sizes": {"1": 1}},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"0": D}, "sizes": {"0": 0}},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"0": D}, "sizes": {"0": 1}, "dialable": "no"},
        {"run": "run", "round": 1, "tokens": 1, "digests": {"0": D}, "sizes": {"0": 1}, "dialable": 0},
        {"run": "run", "round": "1", "tokens": 1, "digests": {"0": D}, "sizes": {"0": 1}},
    ],
)
def test_malformed_contrib_bodies(body):
    with pytest.raises(ProtocolError):
        parse_contrib(sign(KIND_CONTRIB, body, ME), ME.peer_id, "run")


def test_unsorted_or_duplicate_accepted_members_are_refused():
    members = [[ME.peer_id, 1, {"0": D}], [ME.peer_id, 1, {"0": D}]]
    with pytest.raises(ProtocolError):
        parse_accepted(sign(KIND_ACCEPTED, {"run": "run", "round": 1, "members": members}, ME), ME.peer_id, "run")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_raise_protocol_error(data):
    for parse in (parse_contrib, parse_accepted):
        try:
            parse(data, ME.peer_id, "run")
        except ProtocolError:
            pass
    try:
        parse_checks(data, ME.peer_id, "run")
    except ProtocolError:
        pass


def test_ban_list_travels_with_the_accepted_set_and_is_bounded():
    a = AcceptedSet(ME.peer_id, 5, (), ((OTHER.peer_id, 9),))
    assert parse_accepted(sign(KIND_ACCEPTED, a.to_body("run"), ME), ME.peer_id, "run").banned == ((OTHER.peer_id, 9),)
    forever = {"run": "run", "round": 5, "members": [], "banned": [[OTHER.peer_id, 10**9]]}
    with pytest.raises(ProtocolError):
        parse_accepted(sign(KIND_ACCEPTED, forever, ME), ME.peer_id, "run")


def test_the_bans_for_undelivered_contributions_travel_marked_and_a_malformed_mark_is_refused():
    a = AcceptedSet(ME.peer_id, 5, (), ((OTHER.peer_id, 9),), (OTHER.peer_id,))
    back = parse_accepted(sign(KIND_ACCEPTED, a.to_body("run"), ME), ME.peer_id, "run")
    assert back.banned == ((OTHER.peer_id, 9),) and back.missed == (OTHER.peer_id,)
    assert back.faulted(5) == []  # what a stage peer's taint counts: nothing false was sent
    both = AcceptedSet(ME.peer_id, 5, (), tuple(sorted([(OTHER.peer_id, 9), (ME.peer_id, 7)])), (OTHER.peer_id,))
    assert both.faulted(5) == [ME.peer_id] and both.faulted(7) == []
    # an older peer's record has no mark: its bans all count as faults
    assert parse_accepted(sign(KIND_ACCEPTED, AcceptedSet(ME.peer_id, 5, (), ((OTHER.peer_id, 9),)).to_body("run"),
                               ME), ME.peer_id, "run").missed == ()
    banned = [[OTHER.peer_id, 9]]
    for bad in ("x", [1], [[OTHER.peer_id]], [OTHER.peer_id, OTHER.peer_id], [ME.peer_id], [{"a": 1}], None):
        body = {"run": "run", "round": 5, "members": [], "banned": banned, "missed": bad}
        with pytest.raises(ProtocolError):
            parse_accepted(sign(KIND_ACCEPTED, body, ME), ME.peer_id, "run")


def test_the_contributors_left_out_with_a_chain_travel_named_and_a_malformed_list_is_refused():
    a = AcceptedSet(ME.peer_id, 5, ((ME.peer_id, 3, {0: "a" * 64}),), (), (), (OTHER.peer_id,))
    back = parse_accepted(sign(KIND_ACCEPTED, a.to_body("run"), ME), ME.peer_id, "run")
    assert back == a and back.dropped == (OTHER.peer_id,)
    # an older peer's record names none
    assert parse_accepted(sign(KIND_ACCEPTED, AcceptedSet(ME.peer_id, 5, ()).to_body("run"), ME), ME.peer_id,
                          "run").dropped == ()
    members = [[ME.peer_id, 3, {"0": "a" * 64}]]
    many = sorted("12D3KooW" + "".join("123456789A"[int(c)] for c in f"{i:044d}") for i in range(MAX_MEMBERS + 1))
    for bad in ("x", [1], [OTHER.peer_id, OTHER.peer_id], [ME.peer_id], ["not a peer"], [{"a": 1}], None, many,
                sorted([OTHER.peer_id, "12D3KooW" + "1" * 44], reverse=True)):
        body = {"run": "run", "round": 5, "members": members, "banned": [], "dropped": bad}
        with pytest.raises(ProtocolError):
            parse_accepted(sign(KIND_ACCEPTED, body, ME), ME.peer_id, "run")
