"""Envelope framing: round trip, forward compatibility, and rejection of every kind of malformed frame."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlbp.protocol import EnvelopeHeader, ProtocolError, body_digest, pack, unpack
from hlbp.protocol.envelope import (
    MAX_HEADER_BYTES,
    PREFIX_SIZE,
    frame_length,
    header_length,
    with_digest,
)

HEADER = EnvelopeHeader(
    run="run-7",
    round=12,
    shard=3,
    sender="12D3KooWPeer",
    tokens=123_456,
    codec="sparseloco",
    codec_params={"k": 64, "fmt": "entropy", "q": 2, "beta": 0.95, "note": None, "dense": False},
)
MAX = 1 << 20
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fields(body: bytes, **changes) -> dict:
    fields = {
        "run": "run-7",
        "round": 12,
        "shard": 3,
        "sender": "12D3KooWPeer",
        "tokens": 5,
        "codec": "dense-fp32",
        "params": {},
        "digest": body_digest(body),
        "enc": "raw",
        "len": len(body),
        "raw_len": len(body),
    }
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not ...}


def _frame(fields: dict, wire: bytes, version: int = 1, magic: bytes = b"HLBP") -> bytes:
    head = msgpack.packb(fields, use_bin_type=True)
    return struct.pack(">4sBI", magic, version, len(head)) + head + wire


@pytest.mark.parametrize("body", [b"", b"\x01\x02\x03", bytes(range(256)) * 7, b"a" * 100_000])
def test_round_trip(body):
    frame = pack(HEADER, body)
    header, out = unpack(frame, MAX)
    assert out == body
    assert header == with_digest(HEADER, body)
    assert header.digest == body_digest(body)


def _wire_fields(frame: bytes) -> dict:
    return msgpack.unpackb(frame[PREFIX_SIZE : PREFIX_SIZE + header_length(frame)], raw=False)


def test_zstd_only_when_it_helps():
    compressible = b"abc" * 10_000
    frame = pack(HEADER, compressible)
    assert _wire_fields(frame)["enc"] == "zstd" and len(frame) < len(compressible) // 10
    incompressible = random.Random(0).randbytes(5000)
    assert _wire_fields(pack(HEADER, incompressible))["enc"] == "raw"
    assert _wire_fields(pack(HEADER, compressible, compress=False))["enc"] == "raw"


def test_unknown_fields_are_ignored():
    body = b"payload"
    header, out = unpack(_frame(_fields(body, future_field=[1, 2, {"x": 3}]), body), MAX)
    assert out == body and header.codec == "dense-fp32"


def test_stream_helpers():
    body = b"x" * 1000
    frame = pack(HEADER, body, compress=False)
    head_len = header_length(frame[:PREFIX_SIZE])
    assert frame_length(frame[: PREFIX_SIZE + head_len]) == len(frame)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"round": ...}, "lacks required field 'round'"),
        ({"digest": ...}, "lacks required field 'digest'"),
        ({"round": "12"}, "must be int"),
        ({"tokens": True}, "must be int"),
        ({"shard": -1}, "out of range"),
        ({"sender": 5}, "must be str"),
        ({"run": "r" * 300}, "longer than"),
        ({"params": [1]}, "must be dict"),
        ({"params": {"k": [1]}}, "unsupported type"),
        ({"params": {"x": float("nan")}}, "not finite"),
        ({"enc": "lz4"}, "unknown"),
        ({"digest": b"\x00" * 31}, "32 bytes"),
        ({"digest": b"\x00" * 32}, "digest"),
        ({"len": 3}, "header says"),
        ({"raw_len": 3}, "header says"),
    ],
)
def test_rejects_bad_header_fields(change, match):
    body = b"payload"
    with pytest.raises(ProtocolError, match=match):
        unpack(_frame(_fields(body, **change), body), MAX)


def test_rejects_bad_framing():
    body = b"payload" * 10
    frame = pack(HEADER, body, compress=False)
    with pytest.raises(ProtocolError, match="magic"):
        unpack(b"XLBP" + frame[4:], MAX)
    with pytest.raises(ProtocolError, match="version 2"):
        unpack(frame[:4] + b"\x02" + frame[5:], MAX)
    with pytest.raises(ProtocolError, match="header says"):
        unpack(frame + b"\x00", MAX)
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(frame, len(frame) - 1)
    with pytest.raises(ProtocolError, match="digest"):
        unpack(frame[:-1] + bytes([frame[-1] ^ 1]), MAX)
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(struct.pack(">4sBI", b"HLBP", 1, MAX_HEADER_BYTES + 1) + b"\x80", MAX)
    with pytest.raises(ProtocolError, match="map"):
        unpack(_frame([1, 2], b""), MAX)
    with pytest.raises(ProtocolError, match="msgpack"):
        unpack(struct.pack(">4sBI", b"HLBP", 1, 1) + b"\xc1", MAX)
    with pytest.raises(ProtocolError, match="must be bytes"):
        unpack("text", MAX)  # type: ignore[arg-type]
    for n in range(len(frame)):
        with pytest.raises(ProtocolError):
            unpack(frame[:n], MAX)


def test_rejects_zstd_bomb_and_lies():
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * 10_000_000)
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(_frame(_fields(b"", enc="zstd", len=len(bomb), raw_len=10_000_000), bomb), MAX)
    # header claims a small body, the frame declares more: refused before decompressing
    with pytest.raises(ProtocolError, match="declares"):
        unpack(_frame(_fields(b"", enc="zstd", len=len(bomb), raw_len=1000), bomb), 100_000_000)
    small = zstandard.ZstdCompressor().compress(b"hello" * 100)
    body = b"hello" * 100
    with pytest.raises(ProtocolError, match="zstd"):
        unpack(
            _frame(_fields(body, enc="zstd", len=len(small) + 2, raw_len=len(body)), small + b"\x00\x00"), MAX
        )
    _, out = unpack(_frame(_fields(body, enc="zstd", len=len(small), raw_len=len(body)), small), MAX)
    assert out == body


def test_pack_refuses_headers_receivers_would_reject():
    with pytest.raises(ValueError):
        pack(EnvelopeHeader("r", -1, 0, "p", 0, "c"), b"")
    with pytest.raises(ValueError):
        pack(EnvelopeHeader("r", 0, 0, "p", 0, "c", {"x": object()}), b"")  # type: ignore[dict-item]


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data):
    try:
        unpack(data, MAX)
    except ProtocolError:
        pass
    try:
        unpack(b"HLBP\x01" + data, MAX)
    except ProtocolError:
        pass


VALID = [pack(HEADER, b"body bytes " * 20), pack(HEADER, b"z" * 2000)]


@FUZZ
@given(which=st.integers(0, 1), pos=st.integers(0, 10**6), value=st.integers(0, 255), cut=st.integers(0, 20))
def test_fuzz_mutations(which, pos, value, cut):
    data = bytearray(VALID[which])
    data[pos % len(data)] = value
    for candidate in (bytes(data), bytes(data[: len(data) - cut]), bytes(data) + bytes(cut)):
        try:
            header, body = unpack(candidate, MAX)
        except ProtocolError:
            continue
        assert body_digest(body) == header.digest
