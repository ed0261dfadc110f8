"""Commitments on stage streams: a signed hop verifies for its sender only, a receiver refuses unsigned and forged
frames and keeps the rest, bounded, and what it serves to an auditor decodes to exactly the frame it received and
nothing an auditor could be fooled with (another frame, another sender, a broken signature)."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from hlbp.peer.node.stagerounds import ChainTaint
from hlbp.peer.swarm.transcript import Notary, Transcript
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import Identity
from hlbp.protocol.stagewire import StageMessage, decode_message, encode_message, frame_commitment
from hlbp.protocol.transcript import (
    FrameKey,
    IndexEntry,
    RoundIndex,
    decode_index,
    decode_kept,
    encode_index,
    encode_kept,
    index_name,
)

ALICE, BOB = Identity.generate(), Identity.generate()
FWD = StageMessage("fwd", session=7, step=3, mb=1, attempt=0, route=(BOB.peer_id,), weight=0.25, round=5, inner=2)
BODY = bytes(range(200))


def key_of(msg: StageMessage, sender: str) -> FrameKey:
    return FrameKey(sender, msg.op, msg.session, msg.step, msg.mb, msg.attempt)


def test_a_sealed_frame_verifies_for_its_sender_and_keeps_what_changes_per_hop_out_of_the_commitment() -> None:
    sealed = Notary(ALICE).seal(FWD, BODY)
    assert len(sealed.sig) == 64
    receiver = Notary(BOB)
    assert receiver.receive(ALICE.peer_id, sealed, BODY) is None
    assert receiver.receive(BOB.peer_id, sealed, BODY) == "a fwd whose signature does not verify"  # not Bob's
    assert frame_commitment(replace(sealed, route=(), busy=(1.0,)), BODY) == frame_commitment(sealed, BODY)
    for changed in (replace(sealed, weight=0.5), replace(sealed, inner=0), replace(sealed, round=6),
                    replace(sealed, mb=2), replace(sealed, loss=1.0)):
        assert receiver.receive(ALICE.peer_id, changed, BODY) is not None
    assert receiver.receive(ALICE.peer_id, sealed, BODY[:-1] + b"\x00") is not None
    assert receiver.receive(ALICE.peer_id, replace(sealed, sig=b""), BODY) == "an unsigned fwd"
    assert len(receiver.transcript) == 1  # only the frame that verified was kept
    ping = StageMessage("ping", session=7)
    assert Notary(ALICE).seal(ping, b"") == ping and receiver.receive(ALICE.peer_id, ping, b"") is None


def test_the_header_carries_the_signature_round_and_inner_step_through_the_wire() -> None:
    sealed = Notary(ALICE).seal(FWD, BODY)
    msg, body = decode_message(encode_message(sealed, BODY), 4096)
    assert msg == sealed and body == BODY
    with pytest.raises(ProtocolError):
        decode_message(encode_message(replace(sealed, sig=b"x" * 63), BODY), 4096)


def test_a_served_frame_decodes_to_the_frame_received_and_an_index_lists_it_by_round() -> None:
    sealed = Notary(ALICE).seal(FWD, BODY)
    receiver = Notary(BOB)
    receiver.receive(ALICE.peer_id, sealed, BODY)
    key = key_of(sealed, ALICE.peer_id)
    served = receiver.transcript.resolve(key.name)
    assert served is not None
    msg, body = decode_kept(served, key, 4096)
    assert body == BODY and (msg.weight, msg.round, msg.inner, msg.sig) == (0.25, 5, 2, sealed.sig)
    assert decode_index(receiver.transcript.resolve(index_name(5)) or b"") == RoundIndex([IndexEntry(key, 2)])
    assert decode_index(receiver.transcript.resolve(index_name(4)) or b"") == RoundIndex([])
    receiver.transcript.flag(key)  # its screen found it an outlier: listed so, and nothing else changes
    receiver.transcript.flag(replace(key, mb=9))  # a frame not kept is not marked
    assert decode_index(receiver.transcript.resolve(index_name(5)) or b"") == RoundIndex([IndexEntry(key, 2, True)])
    for name in ("audit/i/x", "audit/f/a/b", f"audit/f/{ALICE.peer_id}/fwd/7/3/1/9", "audit/f/../fwd/1/2/3/4",
                 "audit/i/" + "9" * 40, "elsewhere"):
        assert receiver.transcript.resolve(name) is None


def test_a_kept_frame_that_lies_about_what_it_is_proves_nothing() -> None:
    sealed = Notary(ALICE).seal(FWD, BODY)
    key = key_of(sealed, ALICE.peer_id)
    good = encode_message(sealed, BODY)
    forged = encode_message(replace(sealed, weight=0.5), BODY)  # a holder that rewrote the frame
    other = replace(key, mb=2)
    with pytest.raises(ProtocolError, match="signature"):
        decode_kept(encode_kept(ALICE.peer_id, forged), key, 4096)
    with pytest.raises(ProtocolError, match="another micro-batch"):
        decode_kept(encode_kept(ALICE.peer_id, good), other, 4096)
    with pytest.raises(ProtocolError, match="another sender"):
        decode_kept(encode_kept(BOB.peer_id, good), key, 4096)
    for junk in (b"", b"\x92\x01\x02", encode_kept(ALICE.peer_id, good[:-3]), b"\xc1" * 10):
        with pytest.raises(ProtocolError):
            decode_kept(junk, key, 4096)
    with pytest.raises(ProtocolError):
        decode_kept(encode_kept(ALICE.peer_id, good), key, 100)  # a body above the caller's limit


def test_an_index_from_a_hostile_holder_raises_one_error_type() -> None:
    entry = IndexEntry(FrameKey(ALICE.peer_id, "bwd", 1, 2, 3, 4), 0)
    marked = IndexEntry(FrameKey(ALICE.peer_id, "fwd", 1, 2, 3, 4), 5, flagged=True)
    assert decode_index(encode_index([entry, marked])) == RoundIndex([entry, marked])
    assert decode_index(encode_index([entry], withdrawn=True)) == RoundIndex([entry], withdrawn=True)
    for rows in ([[ALICE.peer_id, "ping", 1, 2, 3, 4, 0, 0]], [[ALICE.peer_id, "fwd", -1, 2, 3, 4, 0, 0]],
                 [["not/a peer", "fwd", 1, 2, 3, 4, 0, 0]], [[ALICE.peer_id, "fwd", 1, 2, 3, 4, 0]], {"a": 1},
                 [[ALICE.peer_id, "fwd", True, 2, 3, 4, 0, 0]], [[ALICE.peer_id, "fwd", 1, 2, 3, 4, 0, 2]],
                 [[ALICE.peer_id, "fwd", 1, 2, 3, 4, 0, 0, 0]]):
        for index in ([0, rows], rows):
            with pytest.raises(ProtocolError):
                decode_index(msgpack.packb(index, use_bin_type=True))
    for bad in ([2, []], [True, []], [-1, []], [0, [], 0], [0], [0, {}], [[], 0]):
        with pytest.raises(ProtocolError):
            decode_index(msgpack.packb(bad, use_bin_type=True))
    with pytest.raises(ProtocolError):
        decode_index(encode_index([entry] * 3), max_entries=2)


def test_the_transcript_keeps_at_most_its_bytes_dropping_the_oldest_first() -> None:
    notary = Notary(ALICE)
    size = len(encode_message(replace(notary.seal(FWD, BODY), route=()), BODY))  # what one kept frame weighs
    kept = Transcript(max_bytes=3 * size - 1)
    for mb in range(5):
        kept.keep(ALICE.peer_id, notary.seal(replace(FWD, mb=mb), BODY), BODY)
    assert len(kept) == 2 and kept.dropped == 3
    assert [e.key.mb for e in kept.index(5)] == [3, 4]
    assert kept.frame(key_of(replace(FWD, mb=0), ALICE.peer_id)) is None


def test_a_stage_is_tainted_in_a_round_by_a_banned_peer_it_received_frames_from_then() -> None:
    receiver = Notary(BOB)
    receiver.receive(ALICE.peer_id, Notary(ALICE).seal(FWD, BODY), BODY)  # round 5
    tainted = ChainTaint(receiver, None).tainted  # type: ignore[arg-type]
    assert tainted(5, [ALICE.peer_id]) and tainted(5, ["someone", ALICE.peer_id])
    assert not tainted(5, [BOB.peer_id]) and not tainted(4, [ALICE.peer_id]) and not tainted(5, [])


def test_a_stage_is_tainted_by_a_peer_of_its_own_swarm_the_round_newly_banned() -> None:
    receiver = Notary(BOB)  # received nothing: the liar sat two hops up its chain
    mates = frozenset({"liar", "upstream"})
    tainted = ChainTaint(receiver, None, lambda: mates).tainted  # type: ignore[arg-type]
    assert not tainted(3, [])
    assert tainted(4, ["someone", "liar"])  # the round that banned it
    assert not tainted(5, ["someone", "liar"])  # its ban carried over: left behind in round 4, not in round 5's chain
    assert not tainted(6, ["other-swarm's liar", "liar"])
    assert not ChainTaint(receiver, None).tainted(5, ["liar"])  # type: ignore[arg-type]


def test_a_phase_withdrawn_after_a_resync_lists_its_rounds_as_withdrawn_until_the_next_phase() -> None:
    notary = Notary(ALICE)
    kept = Transcript()

    def keep(r: int, mb: int) -> None:
        kept.keep(ALICE.peer_id, notary.seal(replace(FWD, round=r, mb=mb), BODY), BODY)

    kept.phase_started(4)
    keep(4, 0)
    kept.phase_started(5)
    keep(5, 0)
    assert not kept.withdraw_phase(4)  # not the phase under way: the resync ended before phase 5 began
    assert not any(kept.withdrawn(r) for r in (4, 5))
    assert kept.withdraw_phase(5)  # phase 5 trained from the state the resync replaced
    keep(6, 1)  # a driver already at round 6 sends on frames this stage still computes from that state
    kept.phase_started(6)  # phase 6 starts from the synced state
    keep(6, 2)
    keep(7, 0)
    assert [r for r in range(3, 9) if kept.withdrawn(r)] == [5, 6]
    assert decode_index(kept.resolve(index_name(5)) or b"").withdrawn
    assert not decode_index(kept.resolve(index_name(7)) or b"").withdrawn
    assert [e.key.mb for e in decode_index(kept.resolve(index_name(6)) or b"").entries] == [1, 2]
