"""The decoder's lean operations: the same functions as their plain torch compositions, holding less for the backward.

What a training step holds from the forward for the backward grows with its tokens, and at a volunteer's batch it
outweighs the parameters' own state (docs/results.md, "Lean operations"). In three places the plain composition
holds more than its backward needs:

- an RMS norm's holds its input and its normalised input; :func:`rms_norm` holds the input and one scale per
  token, and normalises again in the backward;
- SwiGLU's down projection's holds the gate, the up projection, ``silu(gate)`` and their product (four tensors of
  the hidden width); :func:`swiglu_down` holds the gate and the up projection and recomputes the rest, elementwise;
- the head's cross-entropy holds the log-probabilities of every token over the whole vocabulary and, in the
  backward, makes two more such tensors; for a batch of more tokens than about the model's width,
  :func:`head_cross_entropy` takes the head's gradients chunk by chunk in the forward instead (a fused linear
  cross-entropy, as Liger-Kernel's), so that no vocabulary-wide tensor larger than one chunk exists and none is
  held.

Each computes the same values as its plain composition up to floating-point rounding (the tests compare them); none
costs another matrix product. All keep the decoder's mixed-precision rule: norms and the loss in float32, whatever
autocast makes of the matrix products.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_LOGITS = 1 << 22  # logits computed at once by the head's loss: 16 MiB of float32 per chunk


class _RMSNorm(torch.autograd.Function):
    """``(x / rms(x)).type_as(x) * weight`` (``weight`` a tensor, or None for a scalar ``gain``), holding x and the
    per-token reciprocal rms."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, gain: float, eps: float) -> torch.Tensor:
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        ctx.gain = gain
        out = (xf * r).type_as(x)
        return out * weight if weight is not None else out * gain

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, r, weight = ctx.saved_tensors
        xf = x.float()
        n = xf * r
        grad_w = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_w = (grad * n.type_as(x)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
            g = (grad * weight).float()
        else:
            g = grad.float() * ctx.gain
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (r * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gain: float = 1.0) -> torch.Tensor:
    """RMS normalisation of the last dimension in float32, cast back to x's dtype, times ``weight`` (per channel)
    or, when it is None, the fixed scalar ``gain``."""
    return _RMSNorm.apply(x, weight, gain, eps)


class _SwiGLUDown(torch.autograd.Function):
    """``linear(silu(gate) * up, w)``, holding gate, up and w."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, w)
        return F.linear(F.silu(gate) * up, w.to(gate.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, w = ctx.saved_tensors
        grad = grad.to(gate.dtype)
        act = F.silu(gate)
        grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ (act * up).reshape(-1, up.shape[-1])).to(w.dtype)
        grad_h = grad @ w.to(gate.dtype)
        grad_up = grad_h * act if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            s = torch.sigmoid(gate)
            grad_gate = grad_h * up * s * (1 + gate * (1 - s))
        return grad_gate, grad_up, grad_w


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SwiGLU's output projection ``linear(silu(gate) * up, w)``, in gate's dtype."""
    return _SwiGLUDown.apply(gate, up, w)


def _chunked_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, want_h: bool, want_w: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean cross-entropy of ``h @ w.T`` against ``targets`` and, where asked, its gradients with respect to h
    (h's shape and dtype) and w (float32), one chunk of logits at a time."""
    flat, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    wc = w.to(h.dtype)
    n, rows = t.numel(), max(1, CHUNK_LOGITS // w.shape[0])
    grad_h = torch.empty_like(flat) if want_h else None
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, n, rows):
        hc, tc = flat[i:i + rows], t[i:i + rows]
        logits = (hc @ wc.t()).float()
        lse = torch.logsumexp(logits, -1)
        total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
        if grad_h is None and grad_w is None:
            continue
        # d(mean loss)/d(logits) = (softmax - onehot) / n, made in place of the logits
        p = logits.sub_(lse[:, None]).exp_()
        p[torch.arange(len(tc), device=p.device), tc] -= 1
        p.div_(n)
        if grad_h is not None:
            grad_h[i:i + len(tc)] = p.to(h.dtype) @ wc
        if grad_w is not None:
            grad_w.addmm_(p.t(), hc.float())
    return total / n, None if grad_h is None else grad_h.reshape(h.shape), grad_w


class _HeadCrossEntropy(torch.autograd.Function):
    """:func:`_chunked_loss` as an autograd function: the backward only scales the gradients the forward took."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, grad_h, grad_w = _chunked_loss(h, w, targets, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        # scaled in place: the head's gradient is handed on, not copied (its size is the head's parameters)
        if grad_h is not None:
            grad_h.mul_(grad)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad).to(ctx.w_dtype)
        return grad_h, grad_w, None


def fused_head(tokens: int, vocab: int, width: int) -> bool:
    """Whether :func:`head_cross_entropy` takes the head's gradients in the forward: when the log-probabilities the
    plain loss holds (tokens x vocab) outweigh the gradients the fused one holds instead (the head's vocab x width
    and the tokens' tokens x width), that is for batches of more tokens than about the model's width."""
    return tokens * vocab > (vocab + tokens) * width


def head_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of the logits ``h @ w.T`` (h: [..., d], w: [vocab, d], targets: [...]),
    in float32. When :func:`fused_head` says so the logits never exist whole (at most :data:`CHUNK_LOGITS` of them
    at a time) and none is held for the backward; otherwise it is the plain loss, which holds fewer bytes then."""
    if not torch.is_grad_enabled() or not (h.requires_grad or w.requires_grad):
        return _chunked_loss(h, w, targets, False, False)[0]
    if not fused_head(targets.numel(), w.shape[0], w.shape[1]):
        return cross_entropy(F.linear(h, w), targets)
    return _HeadCrossEntropy.apply(h, w, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of whole ``logits`` [..., vocab] against ``targets`` [...], in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
