"""The body of a stage peer's gradient share (hlbp.protocol.gradshare): exact bits through the wire, and every
defect one error type, found before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hlbp.protocol import ProtocolError
from hlbp.protocol.gradshare import decode_share, encode_share, mask_bytes, max_share_bytes

SHAPES = {"w": (3, 4), "b": (4,)}


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_a_share_keeps_every_bit_of_the_gradient_and_names_its_micro_batches() -> None:
    grads = _grads()
    grads["w"][0, 0] = 1e-40  # a subnormal survives too
    body = encode_share({0, 3, 9}, 10, grads)
    share = decode_share(body, 10, SHAPES)
    assert share.mbs == frozenset({0, 3, 9})
    assert share.grads is not None
    for name, t in grads.items():
        assert torch.equal(share.grads[name].view(torch.int32), t.view(torch.int32))
    assert len(body) <= max_share_bytes(10, SHAPES)


def test_a_share_without_a_gradient_says_the_senders_was_not_finite() -> None:
    body = encode_share([1], 3, None)
    assert body == b"\x02" and decode_share(body, 3, SHAPES).grads is None


@pytest.mark.parametrize("case", ["empty", "no micro-batch", "past count", "too long", "wrong shape", "missing",
                                  "nan", "bad count"])
def test_a_bad_share_is_refused(case: str) -> None:
    good = encode_share([0], 10, _grads())
    count = 10
    if case == "empty":
        body = b""
    elif case == "no micro-batch":
        body = b"\x00\x00" + good[2:]
    elif case == "past count":
        body = b"\x01\x04" + good[2:]  # bit 10 of a step of 10
    elif case == "too long":
        body = good + b"\x00" * max_share_bytes(10, SHAPES)
    elif case == "wrong shape":
        body = encode_share([0], 10, {"w": torch.zeros(4, 3), "b": torch.zeros(4)})
    elif case == "missing":
        body = encode_share([0], 10, {"w": torch.zeros(3, 4)})
    elif case == "nan":
        body = encode_share([0], 10, {"w": torch.full((3, 4), float("nan")), "b": torch.zeros(4)})
    else:
        body, count = good, 0
    with pytest.raises(ProtocolError):
        decode_share(body, count, SHAPES)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_decode_or_raise_the_protocol_error(body: bytes) -> None:
    try:
        share = decode_share(body, 12, SHAPES)
    except ProtocolError:
        return
    assert share.mbs and max(share.mbs) < 12


def test_the_mask_is_one_bit_per_micro_batch() -> None:
    assert [mask_bytes(n) for n in (1, 8, 9, 4096)] == [1, 1, 2, 512]
    with pytest.raises(ValueError):
        encode_share([5], 5, None)
