"""Regression tests for what the structure-aware fuzzer found: each input once crashed, hung, amplified or was
accepted; now each raises ProtocolError with a message that says what is wrong."""

from __future__ import annotations

import json
import resource
import time

import msgpack
import pytest
import torch
import zstandard

from hlbp.protocol import ProtocolError
from hlbp.protocol import envelope as env
from hlbp.protocol.dense import decode_dense, encode_dense, read_header
from hlbp.protocol.frames import decode_header
from hlbp.protocol.identity import ENVELOPE_MAGIC, ENVELOPE_SCHEMA, Identity, _signed_message, b58decode
from hlbp.protocol.manifest import Manifest, check_run_id, check_sha256, decode_manifest, encode_manifest
from hlbp.protocol.roundwire import (
    KIND_ACCEPTED,
    KIND_CHECKS,
    KIND_CONTRIB,
    ContribNotice,
    parse_accepted,
    parse_checks,
    parse_contrib,
    sign,
)
from hlbp.protocol.shard import decode_shard_sparse, encode_shard, max_shard_size
from hlbp.protocol.sparse import compress
from hlbp.protocol.untrusted import preview, unpack_msgpack
from hlbp.protocol.zstdframe import decompress_bounded

ID = Identity(bytes([5]) * 32)
OTHER = Identity(bytes([6]) * 32)
RUN = "run-1"
SHA = "ab" * 32
SHAPES = {"w": (64, 128), "b": (130,)}


def reseal(kind: str, body: bytes, identity: Identity = ID) -> bytes:
    """A validly signed envelope over arbitrary body bytes, as an attacker with its own key makes them."""
    signer = b58decode(identity.peer_id)
    sig = identity.sign(_signed_message(kind, signer, body))
    return msgpack.packb([ENVELOPE_MAGIC, ENVELOPE_SCHEMA, kind, signer, body, sig], use_bin_type=True)


def deep(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- msgpack: nesting, canonical form, duplicate keys, error messages -------------------------------------------


def test_deep_nesting_is_refused_before_anything_recurses():
    body = b"\x82" + msgpack.packb("run") + msgpack.packb(RUN) + msgpack.packb("round") + deep(1000)
    with pytest.raises(ProtocolError, match="nested deeper than 8 levels"):
        parse_accepted(reseal(KIND_ACCEPTED, body), ID.peer_id, RUN)
    with pytest.raises(ProtocolError, match="not valid msgpack"):  # beyond msgpack's own stack limit
        unpack_msgpack(deep(5000), max_bytes=1 << 20, what="x")


def test_error_messages_never_render_hostile_nested_values():
    nested = [[[[1]]]]
    assert preview(nested) == "<list>"
    assert preview("x" * 100, 5) == "'xxxxx'"
    body = manifest_body()
    body["seed"] = nested
    with pytest.raises(ProtocolError, match=r"record field 'seed' must be an integer in \[0, .*\], got <list>"):
        decode_manifest(reseal("manifest", msgpack.packb(body, use_bin_type=True)))
    items = [ENVELOPE_MAGIC, ENVELOPE_SCHEMA, nested, b"x", b"y", bytes(64)]
    with pytest.raises(ProtocolError, match="expected a manifest record, got <list>"):
        decode_manifest(msgpack.packb(items, use_bin_type=True))


def test_non_canonical_msgpack_is_refused():
    assert unpack_msgpack(msgpack.packb({"a": 5}), max_bytes=100, what="x") == {"a": 5}
    with pytest.raises(ProtocolError, match="x is not canonical msgpack"):
        unpack_msgpack(b"\x81\xa1a\xcf" + (5).to_bytes(8, "big"), max_bytes=100, what="x")  # uint64 for 5
    with pytest.raises(ProtocolError, match="x is not canonical msgpack"):
        unpack_msgpack(b"\x81\xa1a\xca\x3f\x00\x00\x00", max_bytes=100, what="x")  # float32 for 0.5
    with pytest.raises(ProtocolError, match="x: msgpack map repeats a key"):
        unpack_msgpack(b"\x82\xa1a\x01\xa1a\x02", max_bytes=100, what="x")
    with pytest.raises(ProtocolError, match=r"x is not valid msgpack \(ValueError: 2 exceeds max_ext_len\(0\)\)"):
        unpack_msgpack(b"\xd4\x05\x00", max_bytes=100, what="x")
    with pytest.raises(ProtocolError, match="x of 101 bytes exceeds the limit of 100"):
        unpack_msgpack(bytes(101), max_bytes=100, what="x")


def test_data_plane_header_with_duplicate_keys_is_refused():
    with pytest.raises(ProtocolError, match="record: msgpack map repeats a key"):
        decode_header(b"\x82\xa2op\xa5probe\xa2op\xa8artifact")


# --- patterns: a trailing newline no longer passes ---------------------------------------------------------------


def manifest_body() -> dict:
    return Manifest(run_id=RUN, seed=1, model="tiny", tokenizer_hash=SHA, stages=((0, 2),)).to_body()


def test_trailing_newline_fails_every_pattern():
    with pytest.raises(ProtocolError, match="record field 'run_id' has an invalid value 'run-1\\\\n'"):
        check_run_id("run-1\n")
    with pytest.raises(ProtocolError, match="record field 'sha256' has an invalid value"):
        check_sha256(SHA[:63] + "\n")
    body = manifest_body()
    body["tokenizer_hash"] = SHA + "\n"
    with pytest.raises(ProtocolError, match="record field 'tokenizer_hash' must be a string of at most 64"):
        decode_manifest(reseal("manifest", msgpack.packb(body, use_bin_type=True)))
    notice = ContribNotice(ID.peer_id, 1, 10, {0: SHA[:63] + "\n"}, {0: 5})
    with pytest.raises(ProtocolError, match="shard 0 digest is not 64 hex digits"):
        parse_contrib(sign(KIND_CONTRIB, notice.to_body(RUN), ID), ID.peer_id, RUN)
    accepted = {"run": RUN, "round": 1, "members": [[OTHER.peer_id + "\n", 1, {"0": SHA}]], "banned": []}
    with pytest.raises(ProtocolError, match="accepted member sender is not a peer id"):
        parse_accepted(sign(KIND_ACCEPTED, accepted, ID), ID.peer_id, RUN)


def test_honest_manifest_still_round_trips():
    m = Manifest(run_id=RUN, seed=1, model="tiny", tokenizer_hash=SHA, stages=((0, 2),))
    assert decode_manifest(encode_manifest(m, ID)).manifest == m


# --- shard keys: canonical decimal only, no duplicates -----------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "00", "01", "٣", "+1", " 1", "1\n", "256"])
def test_non_canonical_shard_keys_are_refused(key):
    body = {"run": RUN, "round": 1, "checksums": {"1": SHA, key: SHA}}
    with pytest.raises(ProtocolError, match="checksums: bad shard index"):
        parse_checks(sign(KIND_CHECKS, body, ID), ID.peer_id, RUN)


def test_duplicate_shard_keys_are_refused():
    head = msgpack.packb({"run": RUN, "round": 1})
    checks = b"\x82" + msgpack.packb("1") + msgpack.packb(SHA) + msgpack.packb("1") + msgpack.packb("cd" * 32)
    body = b"\x83" + head[1:] + msgpack.packb("checksums") + checks
    with pytest.raises(ProtocolError, match="record: msgpack map repeats a key"):
        parse_checks(reseal(KIND_CHECKS, body), ID.peer_id, RUN)


# --- zstd: canonical frames, expected sizes, no amplification ----------------------------------------------------


def test_zstd_frame_declaring_zero_bytes_is_refused_whatever_follows():
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"") + b"garbage"
    with pytest.raises(ProtocolError, match="s: a zstd frame of 16 bytes declaring 0 is not canonical"):
        decompress_bounded(frame, 1000, "s")


def test_zstd_bomb_is_refused_by_its_declared_size_before_decompressing():
    sink = zstandard.ZstdCompressor(level=1, write_content_size=True)
    bomb = sink.compress(bytes(64 << 20))
    before, t0 = _maxrss(), time.perf_counter()
    with pytest.raises(ProtocolError, match=r"s: zstd frame declares 67108864 bytes, more than the 5000 allowed"):
        decompress_bounded(bomb, 5000, "s")
    assert time.perf_counter() - t0 < 0.1 and _maxrss() - before < 16 << 20


def test_zstd_round_trip_still_works():
    raw = bytes(range(256)) * 4
    assert decompress_bounded(zstandard.ZstdCompressor(write_content_size=True).compress(raw), len(raw), "s") == raw


def test_envelope_body_is_bounded_by_what_the_receiver_expects():
    raw = bytes(1 << 20)
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    head = env.EnvelopeHeader("r", 1, 0, "p", 1, "dense-fp32")
    data = env.pack(head, raw)
    assert len(data) < 1000 and env.unpack(data, 1 << 30)[1] == raw
    with pytest.raises(ProtocolError, match=f"envelope body of {1 << 20} bytes exceeds the limit of 5000"):
        env.unpack(data, 1 << 30, max_body=5000)
    assert len(frame) < 1000


def test_max_shard_size_bounds_every_honest_body():
    g = torch.Generator().manual_seed(0)
    for quant in (2, None):
        tensors = {n: compress(torch.randn(s, generator=g), 64, quant) for n, s in SHAPES.items()}
        for fmt in ("entropy", "packed12"):
            body = encode_shard(tensors, fmt)
            assert len(body) <= max_shard_size(SHAPES, 64, quant)
            assert set(decode_shard_sparse(body, SHAPES)) == set(SHAPES)


# --- dense safetensors: header checked before safetensors or torch see it ----------------------------------------


def _with_header(data: bytes, change) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


DENSE = encode_dense({n: torch.ones(s) for n, s in SHAPES.items()})


@pytest.mark.parametrize("dtype", ["U16", "F8_E4M3", "C64", "F4", "f32"])
def test_dense_dtype_torch_lacks_is_a_protocol_error(dtype):
    data = _with_header(DENSE, lambda h: h["w"].update(dtype=dtype))
    with pytest.raises(ProtocolError, match=f"dense payload: tensor 'w' has dtype '{dtype}', accepted: F32"):
        decode_dense(data, SHAPES, "fp32")


@pytest.mark.parametrize(("shape", "match"), [
    ([2**62, 2**62], r"shape must be at most 8 dims in 0..2\*\*40"),
    ([2**40, 2**40, 2**40], "data_offsets do not match its shape and dtype"),
    ([-1], "shape must be at most"),
    ([1.5], "shape must be at most"),
])
def test_dense_shapes_that_overflow_are_refused(shape, match):
    data = _with_header(DENSE, lambda h: h["w"].update(shape=shape))
    with pytest.raises(ProtocolError, match=match):
        decode_dense(data, SHAPES, "fp32")


def test_dense_header_json_nesting_and_duplicates_are_refused():
    nested = b"[" * 100_000
    data = (len(nested)).to_bytes(8, "little") + nested
    with pytest.raises(ProtocolError, match="safetensors header is not valid JSON"):
        read_header(data)
    dup = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(ProtocolError, match="repeats a tensor name"):
        read_header(len(dup).to_bytes(8, "little") + dup + bytes(4))


def test_dense_offsets_must_tile_the_data():
    data = _with_header(DENSE, lambda h: h["w"].update(data_offsets=[0, 64 * 128 * 4]))
    with pytest.raises(ProtocolError, match="overlap or leave gaps|data_offsets do not match"):
        decode_dense(data, SHAPES, "fp32")
    with pytest.raises(ProtocolError, match="safetensors data is"):
        decode_dense(DENSE + bytes(4), SHAPES, "fp32", max_bytes=1 << 20)
