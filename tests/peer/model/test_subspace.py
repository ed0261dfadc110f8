"""Subspace pieces: U and T_fixed, the codecs' math and gradients, drift absorption, and the constrained model."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.basis import fixed_table, off_span, project_rows, resolve_rank, subspace_basis
from hlbp.peer.model.codec import CodecConfig, DenseCodec
from hlbp.peer.model.decoder import ModelConfig, build_model
from hlbp.peer.model.subspace import (
    SubspaceCodec,
    SubspaceConstraint,
    absorb_drift,
    constrained_model_config,
    drift_table,
    make_codec,
)
from hlbp.protocol import ProtocolError

D, K, V = 8, 3, 11


def _codec(variant: str, wire: str = "fp64", k: int = K) -> SubspaceCodec:
    basis = subspace_basis(D, k, seed=3)
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(4))
    return SubspaceCodec(variant, basis, table, wire)


@pytest.mark.parametrize(
    ("rank", "d", "k"),
    [("1/8", 128, 16), ("1/32", 128, 4), ("1/128", 128, 1), ("1/1024", 128, 1), (0.25, 64, 16), ("40", 4096, 40),
     (16, 128, 16), ("0.5", 8, 4)],
)
def test_resolve_rank(rank, d, k):
    assert resolve_rank(rank, d) == k


@pytest.mark.parametrize("rank", ["0", "129", "abc", "1/0", "2.5", "-3"])
def test_resolve_rank_rejects(rank):
    with pytest.raises(UserInputError):
        resolve_rank(rank, 128)


def test_basis_is_orthonormal_and_a_pure_function_of_the_seed():
    u = subspace_basis(64, 8, seed=5)
    assert u.shape == (64, 8) and u.dtype == torch.float32
    assert torch.allclose(u.T @ u, torch.eye(8), atol=1e-6)
    assert torch.equal(u, subspace_basis(64, 8, seed=5))
    assert not torch.allclose(u, subspace_basis(64, 8, seed=6))
    t = fixed_table(50, 64, seed=5, std=2.0)
    assert torch.equal(t, fixed_table(50, 64, seed=5, std=2.0))
    assert torch.linalg.matrix_rank(t) == 50  # high rank: the anchor can tell every token apart


@pytest.mark.parametrize("variant", ["subspace-a", "subspace-b", "subspace-a-drift"])
def test_reconstruction_is_the_projection_and_backward_is_g_u_ut(variant):
    codec = _codec(variant)
    h = torch.randn(2, 5, D, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 5))
    got = codec.decode_forward(codec.encode_forward(h, ids), shape=(2, 5))
    t = codec.table.double()[ids]
    assert torch.allclose(got.tensor, project_rows(h - t, codec.basis.double()) + t, atol=1e-12)
    assert torch.equal(got.token_ids, ids)
    g = torch.randn(2, 5, D, dtype=torch.float64)
    back = codec.decode_backward(codec.encode_backward(g), shape=(2, 5)).tensor
    u = codec.basis.double()
    assert torch.allclose(back, g @ u @ u.T, atol=1e-12)
    # lossless when h − T[x] already lies in span(U): up to U's float32 orthonormality, as every peer builds it
    inside = t + project_rows(torch.randn(2, 5, D, dtype=torch.float64), u)
    assert torch.allclose(codec.decode_forward(codec.encode_forward(inside, ids)).tensor, inside, atol=1e-6)


@pytest.mark.parametrize("codec", [DenseCodec(D, "fp64"), _codec("subspace-a"), _codec("subspace-b"),
                                   _codec("subspace-a-drift", k=1)], ids=lambda c: type(c).__name__)
def test_gradients_through_codec_module_pass_gradcheck(codec):
    h = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (2, 3))
    assert torch.autograd.gradcheck(lambda x: codec(x, ids), (h,), eps=1e-6, atol=1e-8)
    assert codec.meter.frames["forward"] > 0 and codec.meter.frames["backward"] > 0


def test_codec_module_forward_and_backward_go_through_the_wire_dtype():
    codec = _codec("subspace-b", wire="bf16")
    h = torch.randn(1, 4, D, requires_grad=True)
    ids = torch.randint(0, V, (1, 4))
    out = codec(h, ids)
    c = ((h.detach() - codec.table[ids]) @ codec.basis).bfloat16().float()
    assert torch.equal(out.detach(), c @ codec.basis.T + codec.table[ids])
    g = torch.randn(1, 4, D)
    (out * g).sum().backward()
    assert torch.equal(h.grad, (g @ codec.basis).bfloat16().float() @ codec.basis.T)
    assert codec.meter.bytes["forward"] == 28 + 4 * (2 * K + 2)
    assert codec.meter.bytes["backward"] == 28 + 4 * 2 * K


def test_decoders_raise_protocol_error_on_foreign_frames():
    a, dense = _codec("subspace-a", wire="fp32"), DenseCodec(D, "bf16")
    h, ids = torch.randn(1, 2, D), torch.randint(0, V, (1, 2))
    with pytest.raises(ProtocolError):
        a.decode_forward(dense.encode_forward(h, ids))
    with pytest.raises(ProtocolError):
        a.decode_backward(a.encode_forward(h, ids))
    with pytest.raises(ProtocolError):
        dense.decode_forward(a.encode_forward(h, ids))
    with pytest.raises(ProtocolError):
        a.decode_forward(a.encode_forward(h, ids), shape=(2, 1))


def test_bytes_per_token_follow_k_not_d():
    sizes = {}
    for d in (64, 256):
        codec = make_codec(CodecConfig("subspace-a", "8"), d, 1000, 64)
        h, ids = torch.randn(4, 16, d), torch.randint(0, 1000, (4, 16))
        sizes[d] = (len(codec.encode_forward(h, ids)), len(codec.encode_backward(h)))
        assert codec.frame_bytes(64)["forward"] == pytest.approx(sizes[d][0] / 64)
    assert sizes[64] == sizes[256]
    dense = DenseCodec(256, "bf16")
    assert len(dense.encode_forward(torch.randn(4, 16, 256), ids)) > 7 * sizes[256][0]


def test_drift_absorption_step_by_step_equals_the_closed_form():
    u = subspace_basis(D, K, seed=0)
    base = fixed_table(V, D, seed=0)
    t_perp, t_s = base.clone(), project_rows(torch.randn(V, D), u)
    embed = t_s.clone()  # the unprojected embedding a peer holds
    for step in range(4):
        update = torch.randn(V, D, generator=torch.Generator().manual_seed(step))  # a sparse step is not in span
        before = t_perp + t_s + update
        t_perp, t_s = absorb_drift(t_perp, t_s + update, u)
        embed = embed + update
        assert torch.allclose(t_perp + t_s, before, atol=1e-5)  # the model's input is unchanged
        assert off_span(t_s, u).abs().max() < 1e-5  # the trainable part is back in span(U)
        assert torch.allclose(t_perp, drift_table(base, embed, u), atol=1e-5)


def _small(**changes: object) -> ModelConfig:
    return ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_seq_len=16).replace(**changes)


def test_constrained_model_keeps_names_init_and_writes_in_span():
    plain, constrained = _small(), constrained_model_config(_small(), CodecConfig("subspace-a", "1/8"), 2)
    assert constrained.subspace_rank == 4 and constrained.constrained_layers == 2
    torch.manual_seed(0)
    a = build_model(plain)
    torch.manual_seed(0)
    b = build_model(constrained)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[n], b.state_dict()[n]) for n in a.state_dict())
    ids = torch.randint(0, 50, (2, 8))
    u, t = b.subspace_basis, b.fixed_table[ids]
    with torch.no_grad():
        h = b.embed_tokens(ids)
        for i, block in b.blocks.items():
            h = block(h, b.rope_cos, b.rope_sin, u)
            rel = float(off_span(h - t, u).norm() / (h - t).norm())
            assert (rel < 1e-5) == (int(i) < 2), (i, rel)  # block 2 belongs to the free last stage


def test_constraint_reprojects_changes_since_sync():
    config = _small(subspace_rank=4, subspace_layers=2)
    model = build_model(config)
    constraint = SubspaceConstraint(dict(model.named_parameters()), config)
    assert set(constraint.targets) == {"embed.weight", "blocks.0.attn.wo.weight", "blocks.0.ffn.w2.weight",
                                       "blocks.1.attn.wo.weight", "blocks.1.ffn.w2.weight"}
    before = {n: p.detach().clone() for n, (p, _) in constraint.targets.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    constraint.reproject()
    u = constraint.basis
    for name, (p, side) in constraint.targets.items():
        change = p.detach() - before[name]
        leak = off_span(change, u) if side == "rows" else change - u @ (u.T @ change)
        assert leak.abs().max() < 1e-5, name


def test_model_config_rejects_bad_subspace_fields():
    for changes in ({"subspace_rank": 33}, {"subspace_rank": -1}, {"subspace_layers": 4}, {"subspace_out_gain": 0.0}):
        with pytest.raises(UserInputError):
            _small(**changes)


@pytest.mark.parametrize("wire", ["fp32", "fp64"])
def test_finite_frames_that_decode_to_inf_are_refused(wire):
    """A frame of finite values near the float max overflows in c·Uᵀ + T[x]; the decoder refuses it."""
    a = _codec("subspace-a", wire=wire)
    ids = torch.randint(0, V, (1, 2))
    big = torch.full((1, 2, K), 3.4e38 if wire == "fp32" else 1.7e308, dtype=torch.float64)
    from hlbp.protocol.activations import encode_activations

    forward = encode_activations(big, "forward", wire, ids, V)
    with pytest.raises(ProtocolError, match="forward subspace frame decodes to NaN or inf"):
        a.decode_forward(forward)
    backward = encode_activations(big, "backward", wire)
    with pytest.raises(ProtocolError, match="backward subspace frame decodes to NaN or inf"):
        a.decode_backward(backward)
