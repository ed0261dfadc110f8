"""Activation frames: exact round trip, sizes that follow the width, and ProtocolError for every malformed frame."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlbp.protocol import ProtocolError
from hlbp.protocol.activations import (
    HEADER,
    HEADER_SIZE,
    KINDS,
    WIRE_DTYPES,
    ActivationSpec,
    decode_activations,
    encode_activations,
    frame_size,
    id_size_for,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 300
FWD = ActivationSpec("forward", width=4, wire_dtype="fp32", vocab_size=VOCAB, max_tokens=64, max_seq_len=16)


def _values(batch: int = 2, seq: int = 5, width: int = 4) -> torch.Tensor:
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(0))


def _ids(batch: int = 2, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _frame(**overrides: int | bytes) -> bytes:
    """A valid forward frame for FWD with some header fields replaced."""
    good = encode_activations(_values(), "forward", "fp32", _ids(), VOCAB, tag=7)
    fields = dict(zip(("magic", "version", "kind", "dtype", "id_size", "tag", "batch", "seq", "width"),
                      HEADER.unpack_from(good)))
    fields.update(overrides)
    return HEADER.pack(*fields.values()) + good[HEADER_SIZE:]


@pytest.mark.parametrize("wire", WIRE_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(wire, kind):
    values = _values()
    ids = _ids() if kind == "forward" else None
    vocab = VOCAB if kind == "forward" else None
    data = encode_activations(values, kind, wire, ids, vocab, tag=2**64 - 1)
    spec = ActivationSpec(kind, 4, wire, vocab, max_tokens=64, max_seq_len=16)
    frame = decode_activations(data, spec, shape=(2, 5))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[wire]
    assert torch.equal(frame.values, values.to(dtype).to(frame.values.dtype))
    assert frame.values.dtype == (torch.float64 if wire == "fp64" else torch.float32)
    assert frame.kind == kind and frame.tag == 2**64 - 1
    if ids is None:
        assert frame.token_ids is None
    else:
        assert torch.equal(frame.token_ids, ids)
    assert len(data) == frame_size(2, 5, 4, wire, id_size_for(vocab))


def test_large_vocabulary_uses_four_byte_ids():
    ids = torch.tensor([[0, 70_000, 99_999]])
    data = encode_activations(torch.zeros(1, 3, 2), "forward", "bf16", ids, 100_000)
    frame = decode_activations(data, ActivationSpec("forward", 2, "bf16", 100_000))
    assert torch.equal(frame.token_ids, ids)
    assert len(data) == HEADER_SIZE + 3 * (2 * 2 + 4)


def test_bytes_per_token_follow_width_not_model_width():
    """A subspace frame's size depends on k and the id width only; d_model never enters it."""
    tokens = 8 * 128
    for k in (1, 4, 16):
        size = frame_size(8, 128, k, "fp32", 2)
        assert size == HEADER_SIZE + tokens * (4 * k + 2)
    assert frame_size(8, 128, 4, "fp32", 2) < frame_size(8, 128, 128, "bf16", 0) / 7


@pytest.mark.parametrize(
    "overrides",
    [
        {"magic": b"HLBP"},
        {"version": 2},
        {"kind": 1},  # backward where forward expected
        {"kind": 9},
        {"dtype": 1},  # bf16 where fp32 expected
        {"dtype": 200},
        {"id_size": 4},
        {"id_size": 0},
        {"width": 5},
        {"batch": 0},
        {"seq": 17},  # over max_seq_len
        {"batch": 13},  # 13 x 5 = 65 tokens, over max_tokens
        {"batch": 2**32 - 1},
        {"seq": 4},  # header says fewer tokens than the body holds
    ],
)
def test_rejects_bad_header(overrides):
    with pytest.raises(ProtocolError):
        decode_activations(_frame(**overrides), FWD)


def test_rejects_wrong_length_shape_and_content():
    good = _frame()
    decode_activations(good, FWD, shape=(2, 5))
    for bad in (good[:-1], good + b"\0", good[:HEADER_SIZE - 1], b""):
        with pytest.raises(ProtocolError):
            decode_activations(bad, FWD)
    with pytest.raises(ProtocolError):
        decode_activations(good, FWD, shape=(5, 2))
    values = _values()
    for poison in (float("nan"), float("inf"), float("-inf")):
        v = values.clone()
        v[1, 2, 3] = poison
        with pytest.raises(ProtocolError):
            decode_activations(encode_activations(v, "forward", "fp32", _ids(), VOCAB), FWD)
    # fp16 overflow on the sender side becomes inf on the wire, and is rejected
    data = encode_activations(torch.full((1, 1, 4), 1e6), "backward", "fp16")
    with pytest.raises(ProtocolError):
        decode_activations(data, ActivationSpec("backward", 4, "fp16"))


def test_rejects_token_ids_outside_vocabulary():
    data = bytearray(_frame())
    struct.pack_into("<H", data, len(data) - 2, VOCAB)  # last id = vocab size
    with pytest.raises(ProtocolError):
        decode_activations(bytes(data), FWD)


def test_encoder_refuses_what_a_receiver_would_reject():
    with pytest.raises(ValueError):
        encode_activations(_values(), "forward", "fp32", _ids() + VOCAB, VOCAB)
    with pytest.raises(ValueError):
        encode_activations(_values(), "forward", "fp32", _ids(), None)
    with pytest.raises(ValueError):
        encode_activations(_values()[0], "backward", "fp32")
    with pytest.raises(ValueError):
        encode_activations(_values(), "sideways", "fp32")
    with pytest.raises(ValueError):
        encode_activations(_values(), "backward", "int8")


@FUZZ
@given(st.binary(max_size=600))
def test_any_bytes_decode_or_raise_protocol_error(data):
    try:
        frame = decode_activations(data, FWD)
    except ProtocolError:
        return
    assert frame.values.shape[-1] == FWD.width and bool(torch.isfinite(frame.values).all())


@FUZZ
@given(
    st.sampled_from([b"HLBA", b"HLBX"]), st.integers(0, 3), st.integers(0, 3), st.integers(0, 5),
    st.sampled_from([0, 2, 4, 7]), st.integers(0, 20), st.integers(0, 20), st.integers(0, 6), st.binary(max_size=400),
)
def test_structured_headers_decode_or_raise_protocol_error(magic, version, kind, dtype, id_size, batch, seq, width,
                                                           body):
    data = HEADER.pack(magic, version, kind, dtype, id_size, 0, batch, seq, width) + body
    try:
        frame = decode_activations(data, FWD)
    except ProtocolError:
        return
    assert frame.token_ids is not None and int(frame.token_ids.max()) < VOCAB


@FUZZ
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_flipped_bytes_decode_or_raise_protocol_error(pos, value):
    data = bytearray(_frame())
    data[pos % len(data)] = value
    try:
        decode_activations(bytes(data), FWD)
    except ProtocolError:
        pass
