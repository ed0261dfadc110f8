"""The decoder's lean operations against their plain torch compositions: the same values and gradients, and exactly
the tensors they are meant to hold for the backward."""

import pytest
import torch
import torch.nn.functional as F

from hlbp.peer.model import ops
from hlbp.peer.model.ops import fused_head, head_cross_entropy, rms_norm, swiglu_down


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _saved(fn, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn(*args)`` and every tensor its graph saved for the backward."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def _plain_norm(x, weight, eps, gain=1.0):
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    return out * weight if weight is not None else out * gain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_is_the_plain_norm_and_holds_its_input_and_one_scale_per_token(dtype, weighted):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 32, generator=g) * 3).to(dtype).requires_grad_()
    w = (torch.randn(32, generator=g) + 1).requires_grad_() if weighted else None
    grad = torch.randn(3, 5, 32, generator=g).to(dtype)
    out, saved = _saved(rms_norm, x, w, 1e-5, 2.5)
    want = _plain_norm(x, w, 1e-5, 2.5)
    assert out.dtype == want.dtype and torch.equal(out, want)
    inputs = (x, w) if weighted else (x,)
    got = torch.autograd.grad(out, inputs, grad)
    plain = torch.autograd.grad(want, inputs, grad)
    for a, b in zip(got, plain):
        assert a.dtype == b.dtype and _rel(a, b) < (1e-6 if dtype == torch.float32 else 1e-2)
    held = [t for t in saved if t is not w]
    assert held[0] is x and held[1].shape == (3, 5, 1) and len(held) == 2


def test_swiglu_down_is_the_plain_composition_and_holds_only_the_gate_and_the_up_projection():
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(2, 7, 48, generator=g).requires_grad_() for _ in range(2))
    w = torch.randn(16, 48, generator=g).requires_grad_()
    grad = torch.randn(2, 7, 16, generator=g)
    out, saved = _saved(swiglu_down, gate, up, w)
    want = F.linear(F.silu(gate) * up, w)
    assert torch.equal(out, want)
    for a, b in zip(torch.autograd.grad(out, (gate, up, w), grad), torch.autograd.grad(want, (gate, up, w), grad)):
        assert _rel(a, b) < 1e-6
    held = [t for t in saved if t is not w]
    assert len(held) == 2 and held[0] is gate and held[1] is up


def test_swiglu_down_keeps_the_gate_dtype_and_hands_the_weight_its_own():
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(4, 24, generator=g).bfloat16().requires_grad_() for _ in range(2))
    w = torch.randn(8, 24, generator=g).requires_grad_()
    out = swiglu_down(gate, up, w)
    want = F.linear(F.silu(gate) * up, w.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and gate.grad.dtype == torch.bfloat16


def test_the_head_is_fused_exactly_when_the_log_probabilities_would_outweigh_its_gradients():
    assert not fused_head(256, 8192, 512)  # the memory bench's 4 x 64 tokens on small: the plain loss holds less
    assert fused_head(2048, 8192, 512)  # 16 x 128
    assert fused_head(10_000, 50_000, 2048)
    assert not fused_head(1, 10, 1) and fused_head(3, 10, 1)  # 30 > 26 only from three tokens on


@pytest.mark.parametrize("chunk", [1 << 22, 7 * 50])  # one chunk; seven tokens a chunk, the last one ragged
@pytest.mark.parametrize("wants", ["both", "h", "w"])
def test_the_fused_head_loss_is_the_plain_loss_with_the_same_gradients(monkeypatch, chunk, wants):
    monkeypatch.setattr(ops, "CHUNK_LOGITS", chunk)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 16, 8, generator=g).requires_grad_(wants != "w")
    w = (torch.randn(50, 8, generator=g) * 0.5).requires_grad_(wants != "h")
    targets = torch.randint(0, 50, (4, 16), generator=g)
    assert fused_head(targets.numel(), 50, 8)
    loss, saved = _saved(head_cross_entropy, h, w, targets)
    want = F.cross_entropy((h @ w.t()).reshape(-1, 50), targets.reshape(-1))
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    # nothing of tokens x vocab is held: the gradients it took, h's shape and the head's
    assert all(t.numel() in (h.numel(), w.numel()) for t in saved if t is not None)
    inputs = [t for t in (h, w) if t.requires_grad]
    got = torch.autograd.grad(loss * 0.25, inputs)  # a scaled loss (gradient accumulation) scales both
    plain = torch.autograd.grad(want * 0.25, inputs)
    for a, b in zip(got, plain):
        assert a.shape == b.shape and _rel(a, b) < 1e-5


def test_the_head_loss_without_gradients_holds_nothing_and_equals_the_plain_loss(monkeypatch):
    monkeypatch.setattr(ops, "CHUNK_LOGITS", 3 * 40)
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(5, 9, 6, generator=g), torch.randn(40, 6, generator=g)
    targets = torch.randint(0, 40, (5, 9), generator=g)
    loss, saved = _saved(head_cross_entropy, h, w, targets)
    assert saved == [] and not loss.requires_grad
    assert float(loss) == pytest.approx(float(F.cross_entropy((h @ w.t()).reshape(-1, 40), targets.reshape(-1))),
                                        rel=1e-6)
