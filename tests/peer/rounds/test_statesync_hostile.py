"""State sync refuses a donor's poisoned optimizer state, and the checksum covers that state."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as st_save

from hlbp.peer.rounds.statesync import encode_state, parse_state, shard_checksum
from hlbp.protocol import ProtocolError

SHAPES = {"a": (3, 4), "b": (5,)}


def _params() -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in SHAPES.items()}


def _blob(**outer: torch.Tensor) -> bytes:
    tensors = {f"p.{n}": t for n, t in _params().items()}
    tensors.update({f"o.{k.replace('__', '.')}": v for k, v in outer.items()})
    return st_save(tensors)


def test_honest_state_round_trips_with_momentum_and_without_error_feedback():
    momentum = {"momentum.a": torch.ones(3, 4), "momentum.b": torch.zeros(5), "ef.a": torch.ones(3, 4)}
    state = parse_state(encode_state(_params(), list(SHAPES), momentum), SHAPES)
    assert set(state.outer) == {"momentum.a", "momentum.b"}  # error feedback never leaves a peer
    assert shard_checksum(state.params, list(SHAPES), state.outer) == shard_checksum(_params(), list(SHAPES), momentum)


@pytest.mark.parametrize(("outer", "match"), [
    ({"momentum__a": torch.full((3, 4), float("nan"))}, "state tensor o.momentum.a is not float32 or has non-finite"),
    ({"momentum__a": torch.ones(3, 4, dtype=torch.float16)}, "tensor 'o.momentum.a' has dtype 'F16', accepted: F32"),
    ({"momentum__a": torch.ones(4, 3)}, r"state tensor o.momentum.a has shape \(4, 3\), expected \(3, 4\)"),
    ({"momentum__zzz": torch.ones(3)}, "holds 'o.momentum.zzz', which is no parameter or public optimizer state"),
    ({"ef__a": torch.ones(3, 4)}, "holds 'o.ef.a', which is no parameter or public optimizer state"),
    ({"junk": torch.ones(1)}, "holds 'o.junk'"),
])
def test_poisoned_optimizer_state_is_refused(outer, match):
    with pytest.raises(ProtocolError, match=match):
        parse_state(_blob(**outer), SHAPES)


def test_parameters_must_be_exact_float32_and_finite():
    bad = {f"p.{n}": t for n, t in _params().items()}
    bad["p.a"] = bad["p.a"].double()
    with pytest.raises(ProtocolError, match="tensor 'p.a' has dtype 'F64', accepted: F32"):
        parse_state(st_save(bad), SHAPES)
    with pytest.raises(ProtocolError, match="does not hold exactly the shard's parameters"):
        parse_state(st_save({"p.a": _params()["a"]}), SHAPES)
    with pytest.raises(ProtocolError, match="state blob is truncated"):
        parse_state(b"\x01", SHAPES)


def test_checksum_covers_public_optimizer_state_but_not_error_feedback():
    params = _params()
    plain = shard_checksum(params, list(SHAPES))
    assert shard_checksum(params, list(SHAPES), {"ef.a": torch.ones(3, 4)}) == plain  # SparseLoCo: unchanged
    m = {"momentum.a": torch.ones(3, 4)}
    with_m = shard_checksum(params, list(SHAPES), m)
    assert with_m != plain
    m["momentum.a"][0, 0] = 1.0000001
    assert shard_checksum(params, list(SHAPES), m) != with_m
