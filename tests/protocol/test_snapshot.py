"""The snapshot a node serves to light clients: its codec and bounds, and what verification accepts or rejects.

Tampering happens inside the signed records and keeps them well-formed msgpack envelopes (the old signature
over a changed body), so the checks that run are the signature checks, not the parser's first line.
"""

from __future__ import annotations

import msgpack
import pytest

from hlbp.protocol import ProtocolError
from hlbp.protocol.announcement import Announcement, encode_announcement
from hlbp.protocol.identity import Identity
from hlbp.protocol.manifest import Artifact, Manifest, encode_manifest
from hlbp.protocol.roundwire import KIND_ACCEPTED, KIND_CHECKS, AcceptedSet, ShardChecks, sign
from hlbp.protocol.snapshot import (
    MAX_SNAPSHOT_BYTES,
    SECTIONS,
    Snapshot,
    build_snapshot,
    decode_snapshot,
    encode_snapshot,
    parse_snapshot_request,
    snapshot_request,
    verify_snapshot,
)

NOW = 1_700_000_000.0
RUN = "run-a"
SHA = "ab" * 32


def tamper(envelope: bytes, **changes) -> bytes:
    """The envelope with ``changes`` applied to its signed body, re-packed around the original signature."""
    magic, schema, kind, signer, body, signature = msgpack.unpackb(envelope, raw=False)
    fields = msgpack.unpackb(body, raw=False)
    fields.update(changes)
    return msgpack.packb([magic, schema, kind, signer, msgpack.packb(fields, use_bin_type=True), signature],
                         use_bin_type=True)


def _manifest(run_id: str, **changes) -> Manifest:
    fields = {"run_id": run_id, "seed": 0, "model": "tiny", "tokenizer_hash": SHA, "stages": ((0, 4),),
              "issued_at": NOW, **changes}
    return Manifest(**fields)


def _ann(ident: Identity, boot: Identity, **changes) -> bytes:
    fields = {"run_id": RUN, "role": "replica", "issued_at": NOW, "expires_at": NOW + 30, "throughput": 5000.0,
              "manifest_signer": boot.peer_id, **changes}
    return encode_announcement(Announcement(**fields), ident)


@pytest.fixture
def swarm():
    boot, a, b = Identity.generate(), Identity.generate(), Identity.generate()
    manifest = _manifest(RUN, tokenizer_hash=SHA, artifacts=(Artifact("tokenizer.json", SHA, 1234),))
    checks = {p.peer_id: sign(KIND_CHECKS, ShardChecks(p.peer_id, 3, {0: SHA, 1: SHA}).to_body(RUN), p)
              for p in (a, b)}
    accepted = {a.peer_id: sign(KIND_ACCEPTED, AcceptedSet(a.peer_id, 3, tuple(sorted(
        [(a.peer_id, 100, {0: SHA}), (b.peer_id, 100, {0: SHA})]))).to_body(RUN), a)}
    snap = Snapshot(RUN, NOW, {boot.peer_id: encode_manifest(manifest, boot)},
                    {boot.peer_id: _ann(boot, boot, role="bootstrap"), a.peer_id: _ann(a, boot),
                     b.peer_id: _ann(b, boot)}, checks, 3, accepted)
    return boot, a, b, snap


def _with(snap: Snapshot, **changes) -> Snapshot:
    return Snapshot(**{**snap.__dict__, **changes})


def test_an_honest_snapshot_round_trips_and_verifies(swarm):
    boot, a, b, snap = swarm
    assert decode_snapshot(encode_snapshot(snap)) == snap
    view = verify_snapshot(decode_snapshot(encode_snapshot(snap)), {boot.peer_id}, False, NOW + 1)
    assert view.manifest is not None and view.manifest.signer == boot.peer_id
    assert set(view.peers) == {boot.peer_id, a.peer_id, b.peer_id} and view.rejected == []
    assert sorted(c.peer for c in view.checks) == sorted([a.peer_id, b.peer_id])
    assert [s.senders() for s in view.accepted] == [sorted([a.peer_id, b.peer_id])]


def test_a_record_changed_in_transit_is_rejected_and_never_used(swarm):
    boot, a, b, snap = swarm
    peers = {**snap.peers, a.peer_id: tamper(snap.peers[a.peer_id], throughput=9e9)}
    checks = {**snap.checks, b.peer_id: tamper(snap.checks[b.peer_id], round=4)}
    accepted = {a.peer_id: tamper(snap.accepted[a.peer_id], members=[])}
    view = verify_snapshot(_with(snap, peers=peers, checks=checks, accepted=accepted), {boot.peer_id}, False, NOW)
    assert set(view.peers) == {boot.peer_id, b.peer_id}
    assert [c.peer for c in view.checks] == [a.peer_id] and view.accepted == []
    assert {(r.kind, r.author) for r in view.rejected} == {
        ("announcement", a.peer_id), ("checks", b.peer_id), ("accepted", a.peer_id)}
    assert all("bad signature" in r.reason for r in view.rejected)


def test_a_tampered_manifest_leaves_nothing_to_trust(swarm):
    boot, _, _, snap = swarm
    forged = {boot.peer_id: tamper(snap.manifests[boot.peer_id], seed=666)}
    view = verify_snapshot(_with(snap, manifests=forged), {boot.peer_id}, False, NOW)
    assert view.manifest is None and view.peers == {} and view.checks == []
    assert [(r.kind, r.author) for r in view.rejected] == [("manifest", boot.peer_id)]


def test_records_filed_under_another_peer_or_run_or_round_are_rejected(swarm):
    boot, a, b, snap = swarm
    other = Identity.generate()
    peers = {**snap.peers, a.peer_id: snap.peers[b.peer_id], other.peer_id: _ann(other, boot, run_id="run-b")}
    view = verify_snapshot(_with(snap, peers=peers, accepted_round=2), {boot.peer_id}, False, NOW)
    reasons = {(r.kind, r.author): r.reason for r in view.rejected}
    assert "stored under peer" in reasons[("announcement", a.peer_id)]
    assert "run-b" in reasons[("announcement", other.peer_id)]
    assert "expected 2" in reasons[("accepted", a.peer_id)]
    assert set(view.peers) == {boot.peer_id, b.peer_id}


def test_trust_follows_the_dialled_peer_unless_signers_are_explicit(swarm):
    boot, a, _, snap = swarm
    # dialling replica a: a's own verified announcement names the bootstrap as the manifest signer
    assert verify_snapshot(snap, {a.peer_id}, False, NOW).manifest.signer == boot.peer_id
    view = verify_snapshot(snap, {a.peer_id}, True, NOW)
    assert view.manifest is None and view.rejected[0].reason.startswith("signed by a peer that is not")
    # a manifest signed by someone else, even validly, is not trusted
    evil = Identity.generate()
    rogue = encode_manifest(_manifest("run-evil", issued_at=NOW + 5), evil)
    view = verify_snapshot(_with(snap, manifests={**snap.manifests, evil.peer_id: rogue}), {boot.peer_id}, False, NOW)
    assert view.manifest.signer == boot.peer_id and [r.author for r in view.rejected] == [evil.peer_id]


def test_expired_announcements_drop_out_quietly(swarm):
    boot, _, _, snap = swarm
    view = verify_snapshot(snap, {boot.peer_id}, True, NOW + 60)
    assert view.manifest is not None and view.peers == {} and view.rejected == []


@pytest.mark.parametrize("body", [
    b"\xc1",  # not msgpack
    msgpack.packb([1, 2]),  # not a map
    msgpack.packb({"v": 2, "run": RUN, "time": NOW}),  # another schema
    msgpack.packb({"v": 1, "run": "../etc", "time": NOW}),  # not a run id
    msgpack.packb({"v": 1, "run": RUN, "time": "now"}),
    msgpack.packb({"v": 1, "run": RUN, "time": NOW, "accepted_round": -1}),
    msgpack.packb({"v": 1, "run": RUN, "time": NOW, "peers": {"x": "a str, not bytes"}}, use_bin_type=True),
    msgpack.packb({"v": 1, "run": RUN, "time": NOW, "peers": {"x": b"y" * 5000}}, use_bin_type=True),
    msgpack.packb({"v": 1, "run": RUN, "time": NOW, "manifests": {str(i): b"" for i in range(65)}},
                  use_bin_type=True),
    msgpack.packb({"v": 1, "run": RUN, "time": NOW, "peers": {"x": {"nested": b""}}}, use_bin_type=True),
    b"\xdc\x00\x01\x01",  # non-canonical (array16 holding one item)
    b"\x80" + b"\0" * MAX_SNAPSHOT_BYTES,  # oversized
])
def test_malformed_snapshots_raise_protocol_error(body):
    with pytest.raises(ProtocolError):
        decode_snapshot(body)


def test_a_server_keeps_its_snapshot_within_bounds():
    big = {f"peer{i:05d}": b"r" * SECTIONS["peers"][1] for i in range(SECTIONS["peers"][0] + 10)}
    odd = {"good": b"m", 7: b"int key", "str": "not bytes", "huge": b"x" * (SECTIONS["manifests"][1] + 1)}

    class Wrapped:  # hivemind's DHT returns values wrapped with their expiration
        value = b"c"

    snap = build_snapshot(RUN, NOW, {"manifests": odd, "peers": big, "checks": {"w": Wrapped()}})
    assert snap.manifests == {"good": b"m"} and snap.checks == {"w": b"c"}
    assert 0 < len(snap.peers) < len(big)
    assert len(encode_snapshot(snap)) <= MAX_SNAPSHOT_BYTES
    assert decode_snapshot(encode_snapshot(snap)) == snap


def test_requests_name_the_op_and_schema():
    parse_snapshot_request(snapshot_request())
    for bad in ({"op": "artifact"}, {"op": "snapshot", "v": 2}, {}):
        with pytest.raises(ProtocolError):
            parse_snapshot_request(bad)


def test_accepted_sets_of_a_snapshot_that_names_no_round_are_rejected(swarm):
    boot, a, _b, snap = swarm
    view = verify_snapshot(_with(snap, accepted_round=None), {boot.peer_id}, False, NOW)
    assert view.accepted == []
    assert [(r.kind, r.author, r.reason) for r in view.rejected] == [
        ("accepted", a.peer_id, "the snapshot names no round for its accepted sets")]
