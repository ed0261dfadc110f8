"""Records passed on in bundles (a committee's forwards and relays) land in the inbox under their signers and are
parsed like any record, so a bundle forges nothing; malformed or far-off bundles are dropped.

The round loop's own ``RoundRecords`` on real signed records; the network tests run bundles between processes
(tests/peer/rounds/test_committee_rounds.py).
"""

from __future__ import annotations

from hlbp.peer.rounds.config import RoundConfig
from hlbp.peer.rounds.records import RoundRecords
from hlbp.protocol.bundle import pack_bundles
from hlbp.protocol.identity import Identity
from hlbp.protocol.roundwire import KIND_BUNDLE, KIND_CONTRIB, ContribNotice, parse_contrib, round_key, sign

RUN = "bundle-test"
IDS = {name: Identity.generate() for name in ("me", "holder", "a", "b", "forger")}
PEER = {name: ident.peer_id for name, ident in IDS.items()}


def _records() -> RoundRecords:
    return RoundRecords(None, IDS["me"], None, RoundConfig(run_id=RUN, inner_steps=1), None, lambda: 5)


def _notice(signer: str, as_: str | None = None, round_: int = 5) -> bytes:
    body = ContribNotice(PEER[signer], round_, 100, {0: "ab" * 32}, {0: 1000}).to_body(RUN)
    return sign(KIND_CONTRIB, body, IDS[as_ or signer])


def test_passed_on_notices_count_as_their_signers_and_a_forged_one_does_not() -> None:
    records = _records()
    key = round_key(RUN, 5, KIND_CONTRIB)
    # "forger" signs a notice naming "b" as its sender: filed under b, it fails b's signature check
    items = [(KIND_CONTRIB, PEER["a"], _notice("a")), (KIND_CONTRIB, PEER["b"], _notice("b", as_="forger"))]
    for body in pack_bundles(5, items, complete=True):
        records.on_push(PEER["holder"], round_key(RUN, 5, KIND_BUNDLE), body)
    assert set(records.inbox.entries(key)) == {PEER["a"], PEER["b"]}
    parsed = records.records(key, parse_contrib, records.inbox.entries(key), round_=5)
    assert [n.sender for n in parsed] == [PEER["a"]]
    assert records.complete_parts(5) == frozenset({PEER["holder"]})
    assert set(records.bundles_from(5)) == {PEER["holder"]}
    assert records.traffic()[0] == 1  # one bundle is one record received, whatever it carries


def test_malformed_and_far_off_bundles_are_dropped() -> None:
    records = _records()
    records.on_push(PEER["holder"], round_key(RUN, 5, KIND_BUNDLE), b"\x93not a bundle")
    far = pack_bundles(9, [(KIND_CONTRIB, PEER["a"], _notice("a", round_=9))], complete=True)[0]
    records.on_push(PEER["holder"], round_key(RUN, 9, KIND_BUNDLE), far)
    wrong_round = pack_bundles(4, [(KIND_CONTRIB, PEER["a"], _notice("a"))], complete=True)[0]
    records.on_push(PEER["holder"], round_key(RUN, 5, KIND_BUNDLE), wrong_round)  # says round 4 under round 5
    assert records.inbox.entries(round_key(RUN, 5, KIND_CONTRIB)) == {}
    assert records.inbox.entries(round_key(RUN, 9, KIND_CONTRIB)) == {}
    assert records.complete_parts(5) == frozenset() and records.bundles_from(5) == {}


def test_a_replicas_seats_follow_the_sets_it_took_and_are_forgotten_on_resync() -> None:
    from hlbp.peer.rounds.committee import CommitteeRule, committee
    from hlbp.peer.rounds.gather import GatherRule
    from hlbp.peer.rounds.seating import Seating

    seating = Seating(PEER["me"], CommitteeRule(4), GatherRule(2, 1), _records(), lambda r, kind, signer, same=None: None)
    assert seating.seats(5) == ()  # round 3's members unknown
    seating.note(2, {PEER["a"], PEER["b"]})
    seating.note(3, {PEER["holder"], PEER["me"]})
    assert seating.seats(5) == committee(5, [{PEER["holder"], PEER["me"]}, {PEER["a"], PEER["b"]}], CommitteeRule(4))
    assert len(seating.seats(5)) == 4 and seating.seats(6) == ()  # round 4 not taken yet
    seating.note(4, {PEER["forger"]})
    assert seating.seats(6)[0] == PEER["forger"] and len(seating.seats(6)) == 4
    seating.forget()
    assert seating.seats(5) == seating.seats(6) == ()


def test_a_notice_key_filled_by_a_flood_says_so() -> None:
    records = _records()
    records.inbox.max_senders = 2
    key = round_key(RUN, 5, KIND_CONTRIB)
    items = [(KIND_CONTRIB, PEER[x], _notice(x)) for x in ("a", "b")]
    records.take_bundle(PEER["holder"], 5, pack_bundles(5, items, complete=False)[0])
    assert not records.inbox.full(key)
    records.on_push(PEER["forger"], key, _notice("forger"))  # a third sender: no room
    assert records.inbox.full(key) and set(records.inbox.entries(key)) == {PEER["a"], PEER["b"]}
