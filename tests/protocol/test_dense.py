"""Dense payloads: exact round trip, and every malformed input raises ProtocolError."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hlbp.protocol import ProtocolError
from hlbp.protocol.dense import decode_dense, dense_size, encode_dense

SHAPES = {"a.weight": (8, 16), "b": (5,)}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_round_trip(dtype):
    t = _tensors()
    data = encode_dense(t, dtype)
    out = decode_dense(data, SHAPES, dtype)
    for n in SHAPES:
        ref = t[n].to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]).float()
        assert torch.equal(out[n], ref)
    assert len(data) >= dense_size(SHAPES, dtype)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: {**t, "b": torch.full((5,), float("nan"))},
        lambda t: {**t, "b": torch.zeros(6)},
        lambda t: {"a.weight": t["a.weight"]},
        lambda t: {**t, "extra": torch.zeros(1)},
    ],
)
def test_rejects_wrong_content(mutate):
    with pytest.raises(ProtocolError):
        decode_dense(encode_dense(mutate(_tensors())), SHAPES, "fp32")


def test_rejects_wrong_dtype_and_oversize():
    data = encode_dense(_tensors(), "bf16")
    with pytest.raises(ProtocolError):
        decode_dense(data, SHAPES, "fp32")
    with pytest.raises(ProtocolError):
        decode_dense(data + b"\0" * 10_000_000, SHAPES, "bf16")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_decode_or_raise_protocol_error(data):
    try:
        decode_dense(data, SHAPES, "fp32")
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_flipped_bytes_decode_or_raise_protocol_error(pos, value):
    data = bytearray(encode_dense(_tensors()))
    data[pos % len(data)] = value
    try:
        decode_dense(bytes(data), SHAPES, "fp32")
    except ProtocolError:
        pass
