"""Signed records: round trips, and every kind of bad input is refused with ProtocolError."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from hlbp.protocol import ProtocolError, RecordExpired
from hlbp.protocol.announcement import (
    KIND_ANNOUNCEMENT,
    MAX_ANNOUNCEMENT_BYTES,
    Announcement,
    decode_announcement,
    encode_announcement,
)
from hlbp.protocol.frames import decode_header, encode_header, header_length, parse_body_size, parse_request
from hlbp.protocol.identity import (
    Identity,
    b58decode,
    b58encode,
    open_envelope,
    peer_id_from_public_key,
    public_key_from_peer_id,
    seal,
)
from hlbp.protocol.manifest import (
    KIND_MANIFEST,
    PROTOCOL_VERSION,
    Artifact,
    Manifest,
    ProtocolVersionMismatch,
    decode_manifest,
    encode_manifest,
)

SHA = "ab" * 32
NOW = 1_000_000.0


def _identity(seed: int) -> Identity:
    return Identity(bytes([seed]) * 32)


MANIFEST = Manifest(run_id="run-1", seed=7, model="tiny", tokenizer_hash=SHA, stages=((0, 2), (2, 4)),
                    artifacts=(Artifact("tokenizer.json", SHA, 123),), issued_at=NOW)
ANNOUNCEMENT = Announcement(run_id="run-1", role="stage", swarm=0, stage=1, throughput=1500.0, bandwidth=2e7,
                            memory_gb=8.0, software="0.1.0", reachability="public",
                            maddrs=("/ip4/127.0.0.1/tcp/4001",), artifacts=(SHA,), seq=3, issued_at=NOW,
                            expires_at=NOW + 60)


def _manifest(**changes) -> Manifest:
    return replace(MANIFEST, **changes)


def _announcement(**changes) -> Announcement:
    return replace(ANNOUNCEMENT, **changes)


def test_base58_round_trip_and_leading_zeros():
    for data in (b"\0", b"\0\0\1", bytes(range(40)), b"\xff" * 38):
        assert b58decode(b58encode(data)) == data
    assert b58encode(b"\0\0\1") == "112"
    with pytest.raises(ProtocolError):
        b58decode("0OIl")


def test_peer_id_embeds_the_public_key_like_libp2p():
    ident = _identity(1)
    assert ident.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key
    assert peer_id_from_public_key(ident.public_key) == ident.peer_id
    with pytest.raises(ProtocolError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # an RSA (sha256) peer id


def test_identity_file_round_trip_and_rejects_other_keys():
    ident = _identity(2)
    again = Identity.from_file_bytes(ident.to_file_bytes())
    assert again.peer_id == ident.peer_id
    with pytest.raises(ProtocolError):
        Identity.from_file_bytes(b"\x08\x00\x12\x40" + bytes(64))  # RSA key type
    tampered = bytearray(ident.to_file_bytes())
    tampered[-1] ^= 1
    with pytest.raises(ProtocolError):
        Identity.from_file_bytes(bytes(tampered))


def test_manifest_round_trip():
    ident = _identity(3)
    data = encode_manifest(_manifest(), ident)
    signed = decode_manifest(data, signer=ident.peer_id)
    assert signed.manifest == _manifest()
    assert signed.signer == ident.peer_id and signed.envelope == data and len(signed.digest) == 64


def test_announcement_round_trip():
    ident = _identity(4)
    data = encode_announcement(_announcement(), ident)
    rec = decode_announcement(data, now=NOW + 1, signer=ident.peer_id, run_id="run-1")
    assert rec.announcement == _announcement() and rec.peer_id == ident.peer_id and rec.size == len(data)


def test_unknown_fields_are_ignored():
    ident = _identity(5)
    body = {**_announcement().to_body(), "gpu": "H100", "future_field": [1, 2, {"x": 3}]}
    rec = decode_announcement(seal(KIND_ANNOUNCEMENT, body, ident), now=NOW, signer=ident.peer_id)
    assert rec.announcement == _announcement()


def test_forged_signature_and_wrong_signer_are_refused():
    owner, forger = _identity(6), _identity(7)
    data = encode_announcement(_announcement(), owner)
    with pytest.raises(ProtocolError, match="stored under"):
        decode_announcement(data, now=NOW, signer=forger.peer_id)
    # Swap the signer field for the forger's id: the signature no longer verifies.
    items = msgpack.unpackb(data, raw=False)
    items[3] = b58decode(forger.peer_id)
    with pytest.raises(ProtocolError, match="bad signature"):
        decode_announcement(msgpack.packb(items, use_bin_type=True), now=NOW)
    # Change one body byte under a valid signature.
    items = msgpack.unpackb(data, raw=False)
    items[4] = items[4].replace(b"stage", b"stagf", 1)
    with pytest.raises(ProtocolError, match="bad signature"):
        decode_announcement(msgpack.packb(items, use_bin_type=True), now=NOW)


def test_unsigned_malformed_and_oversized_are_refused():
    ident = _identity(8)
    good = msgpack.unpackb(encode_announcement(_announcement(), ident), raw=False)
    unsigned = msgpack.packb(good[:5] + [b"\0" * 64], use_bin_type=True)
    cases = [unsigned, b"", b"\xc1", b"garbage", msgpack.packb([b"hlbp", 1]), msgpack.packb({"a": 1}), 12345,
             b"\x91" * 3000]
    for bad in cases:
        with pytest.raises(ProtocolError):
            decode_announcement(bad, now=NOW)
    oversized = seal(KIND_ANNOUNCEMENT, {**_announcement().to_body(), "pad": "x" * MAX_ANNOUNCEMENT_BYTES}, ident)
    with pytest.raises(ProtocolError, match="limit"):
        decode_announcement(oversized, now=NOW)
    with pytest.raises(ProtocolError, match="expected a announce record|expected a"):
        decode_announcement(encode_manifest(_manifest(), ident), now=NOW)


def test_expired_future_and_other_run_records_are_refused():
    ident = _identity(9)
    data = encode_announcement(_announcement(), ident)
    with pytest.raises(RecordExpired, match="expired"):
        decode_announcement(data, now=NOW + 61)
    with pytest.raises(ProtocolError, match="future") as future:
        decode_announcement(data, now=NOW - 1000)
    assert not isinstance(future.value, RecordExpired)  # only expiry is the quiet, typed end of a record
    with pytest.raises(ProtocolError, match="belongs to run"):
        decode_announcement(data, now=NOW, run_id="other")
    too_long = encode_announcement(_announcement(expires_at=NOW + 10 * 3600), ident)
    with pytest.raises(ProtocolError, match="expire within"):
        decode_announcement(too_long, now=NOW)


def test_bad_field_values_are_refused():
    ident = _identity(10)
    for changes in ({"role": "king"}, {"throughput": float("nan")}, {"stage": None}, {"reachability": "x"},
                    {"artifacts": ("not-a-hash",)}, {"run_id": "../etc"}):
        body = {**_announcement().to_body(), **{("run" if k == "run_id" else k): v for k, v in changes.items()}}
        body = {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}
        with pytest.raises(ProtocolError):
            decode_announcement(seal(KIND_ANNOUNCEMENT, body, ident), now=NOW)
    for stages in ([[0, 2], [3, 4]], [[1, 2]], [], [[0, 0]], [[0, True]]):
        body = {**_manifest().to_body(), "stages": stages}
        with pytest.raises(ProtocolError):
            decode_manifest(seal(KIND_MANIFEST, body, ident))


def test_protocol_version_mismatch_is_its_own_error_with_a_message():
    ident = _identity(11)
    data = seal(KIND_MANIFEST, {**_manifest().to_body(), "proto": PROTOCOL_VERSION + 1}, ident)
    with pytest.raises(ProtocolVersionMismatch,
                       match=f"protocol version {PROTOCOL_VERSION + 1}.*speaks version {PROTOCOL_VERSION}"):
        decode_manifest(data)
    # The envelope itself is valid: a DHT validator can pass it on for the joiner to explain.
    assert open_envelope(data, KIND_MANIFEST, max_bytes=1 << 14).signer == ident.peer_id


def test_data_plane_headers():
    frame = encode_header({"op": "artifact", "sha256": SHA})
    assert header_length(frame[:4]) == len(frame) - 4
    assert parse_request(decode_header(frame[4:])) == ("artifact", SHA)
    assert parse_request({"op": "probe", "bytes": 10}) == ("probe", 10)
    for bad in ({"op": "rm"}, {"op": "probe", "bytes": -1}, {"op": "probe", "bytes": 1 << 40},
                {"op": "artifact", "sha256": "zz"}):
        with pytest.raises(ProtocolError):
            parse_request(bad)
    with pytest.raises(ProtocolError):
        header_length((1 << 20).to_bytes(4, "big"))
    assert parse_body_size({"size": 5}, 10) == 5
    with pytest.raises(ProtocolError, match="peer refused"):
        parse_body_size({"error": "no artifact"}, 10)
    with pytest.raises(ProtocolError):
        parse_body_size({"size": 11}, 10)


def test_round_settings_and_allow_list_travel_in_the_manifest():
    from hlbp.protocol.manifest import Hyperparameters

    members = tuple(sorted(_identity(s).peer_id for s in (4, 5)))
    hp = Hyperparameters(aggregation="mean", weighting="tokens", clip_median=False, max_contribution_ratio=3.0,
                         max_update_ratio=0.5, max_loss_jump=4.0, schedule_steps=450, small_tensors="dense",
                         gather=16, reserves=8, unselected="keep")
    ident = _identity(3)
    signed = decode_manifest(encode_manifest(_manifest(hparams=hp, allowed_peers=members), ident), signer=ident.peer_id)
    assert signed.manifest.hparams == hp and signed.manifest.allowed_peers == members
    assert signed.manifest.may_contribute(members[0]) and not signed.manifest.may_contribute(_identity(6).peer_id)
    assert _manifest().may_contribute(_identity(6).peer_id)  # an open run
    defaults = Hyperparameters()
    assert (defaults.aggregation, defaults.weighting, defaults.clip_median) == ("selectors", "equal", True)
    # the inner schedule every peer follows: the manifest's length, or 1000 rounds of H
    assert hp.schedule_total == 450 and Hyperparameters(inner_steps=7).schedule_total == 7000
    for bad in ({"aggregation": "median"}, {"weighting": "stake"}, {"clip_median": 1}, {"max_loss_jump": 0.5},
                {"schedule_steps": -1}, {"schedule_steps": 1.5}, {"small_tensors": "all"}, {"gather": 257},
                {"gather": -1}, {"reserves": 1000}, {"gather": 2, "min_contributors": 3},
                {"gather": 4, "outer": "diloco", "overlap": "none"}, {"unselected": "lose"}):
        with pytest.raises(ProtocolError):
            Hyperparameters.from_body(bad)
    body = _manifest().to_body()
    for allowed in ([members[1], members[0]], [members[0], members[0]], ["12D3KooWnot-a-key"]):
        with pytest.raises(ProtocolError):  # unsorted, repeated (two encodings of one set) or not a peer id
            Manifest.from_body({**body, "allowed_peers": allowed})


def test_overlap_defaults_to_eager_for_sparseloco_and_none_for_diloco():
    from hlbp.protocol.manifest import Hyperparameters

    assert Hyperparameters().overlap == "eager" and Hyperparameters(outer="diloco").overlap == "none"
    # a body that does not name it gets its outer's default; a manifest always names it (to_body), so a run keeps
    # the mode it was signed with whatever a later release's default is
    assert Hyperparameters.from_body({}).overlap == "eager"
    assert Hyperparameters.from_body({"outer": "diloco"}).overlap == "none"
    assert Hyperparameters.from_body({"overlap": "none"}).overlap == "none"
    assert _manifest(hparams=Hyperparameters(overlap="naive")).to_body()["hparams"]["overlap"] == "naive"
    assert _manifest().to_body()["hparams"]["overlap"] == "eager"
    assert Hyperparameters.from_body({"outer": "noloco"}).overlap == "none"
    assert Hyperparameters.from_body({"outer": "noloco"}).noloco_payload == "dense"
    assert Hyperparameters.from_body({"outer": "noloco", "noloco_payload": "sparse"}).noloco_payload == "sparse"
    for bad in ({"outer": "diloco", "overlap": "eager"}, {"outer": "diloco", "overlap": "naive"},
                {"overlap": "lazy"}, {"overlap": ""}, {"outer": "noloco", "overlap": "eager"},
                {"outer": "noloco", "gather": 2}, {"outer": "noloco", "noloco_payload": "half"}):
        with pytest.raises(ProtocolError):  # the dense baseline's all-reduce cannot run beside a phase
            Hyperparameters.from_body(bad)


def test_variant_a_runs_do_not_overlap_their_full_replicas():
    # their full replicas train the constrained network, whose parameters an overlapped landing cannot shift
    from hlbp.peer.model.subspace import CONSTRAINED
    from hlbp.protocol.manifest import CodecSpec

    assert CodecSpec.CONSTRAINED == CONSTRAINED  # the protocol's copy of the model's list
    body = _manifest().to_body()
    hparams = {k: v for k, v in body["hparams"].items() if k != "overlap"}
    for name in ("subspace-a", "subspace-a-drift"):
        codec = {"name": name, "k": 4}
        assert Manifest.from_body({**body, "hparams": hparams, "codec": codec}).hparams.overlap == "none"
        with pytest.raises(ProtocolError, match="subspace-a"):
            Manifest.from_body({**body, "hparams": {**hparams, "overlap": "eager"}, "codec": codec})
    codec = {"name": "subspace-b", "k": 4}
    assert Manifest.from_body({**body, "hparams": hparams, "codec": codec}).hparams.overlap == "eager"
