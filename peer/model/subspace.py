"""Compression of pipeline stage boundaries (ALGORITHMS.md §3): the shared basis U, the anchor table T_fixed, the
activation codecs, and the constraints of the exact subspace network (variant A).

Every codec is an ``nn.Module`` whose forward is a custom autograd function: the forward pass encodes the
activations to wire bytes and decodes them as the next stage would, the backward pass does the same with the
activation-gradient. The four byte-level methods (``encode_forward`` / ``decode_forward`` / ``encode_backward`` /
``decode_backward``) are what a network pipeline calls on each side of a real link; the in-process pipeline calls
exactly the same ones.

Subspace codecs (k values per token instead of d_model):

- forward: send c = (h − T_fixed[x])·U with the token ids x; the receiver rebuilds h = c·Uᵀ + T_fixed[x];
- backward: send g·U; the sender of the activations uses g·U·Uᵀ, which is the exact gradient of the forward map.

Variants, which differ only in the model they run on and in how T_fixed is kept (:func:`anchor_table`):

- ``subspace-a``: T_fixed is a frozen random table; the model (``ModelConfig.subspace_rank``) keeps every
  residual-stream write in span(U), so the codec is lossless.
- ``subspace-a-drift``: as A, but after each outer step the embedding's part outside span(U) moves into T_fixed.
- ``subspace-b``: no constraint; T_fixed is the synchronized embedding, rebuilt after each outer step; lossy.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.basis import (
    fixed_table,
    off_span,
    project_rows,
    project_writer,
    resolve_rank,
    subspace_basis,
)
from hlbp.peer.model.decoder import ModelConfig
from hlbp.protocol import ProtocolError
from hlbp.protocol.activations import (
    HEADER_SIZE,
    ActivationSpec,
    decode_activations,
    element_size,
    encode_activations,
)

CODEC_KINDS = ("dense", "subspace-a", "subspace-b", "subspace-a-drift")
"""Activation codecs a run can name."""
VARIANTS = ("subspace-a", "subspace-b", "subspace-a-drift")
"""The subspace codecs."""
CONSTRAINED = ("subspace-a", "subspace-a-drift")
"""Variants that run on the constrained model of ALGORITHMS.md §3 (A)."""
REBUILT = ("subspace-b", "subspace-a-drift")
"""Variants whose T_fixed is a function of the synchronized embedding, rebuilt after every outer step."""
SHORT_NAMES = {"dense": "dense", "subspace-a": "A", "subspace-b": "B", "subspace-a-drift": "A+drift"}
"""Labels for tables."""


# --- variant-specific anchor tables -----------------------------------------------------------------------------


def drift_table(base: torch.Tensor, embed: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """T_⊥ under drift absorption: the seed table plus everything of the embedding outside span(U).

    Absorbing after every outer step (:func:`absorb_drift`) adds each step's off-span part of the embedding to
    T_⊥ and leaves T_S = embed·U·Uᵀ; summed over the run that is exactly this, so every peer gets T_⊥ from the
    seed and the synchronized embedding alone, with no history to keep or transfer.
    """
    return base + off_span(embed.to(base), basis)


def absorb_drift(t_perp: torch.Tensor, t_s: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One drift absorption as ALGORITHMS.md §3 states it: P = T_S·U·Uᵀ; T_⊥ ← T_⊥ + (T_S − P); T_S ← P."""
    p = project_rows(t_s, basis)
    return t_perp + (t_s - p), p


def anchor_table(variant: str, base: torch.Tensor | None, embed: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """T_fixed that every peer uses at every boundary after an outer step, from the synchronized embedding."""
    if variant == "subspace-b":
        return embed.detach().float().clone()
    if variant not in CONSTRAINED:
        raise ValueError(f"no anchor table for codec {variant!r}")
    if base is None:
        raise ValueError(f"codec {variant} needs the seed table T_fixed")
    return base if variant == "subspace-a" else drift_table(base, embed, basis)


# --- variant A: the constrained model -----------------------------------------------------------------------------


def constrained_names(config: ModelConfig) -> dict[str, str]:
    """Parameters whose changes must stay in span(U): ``"rows"`` (embedding) or ``"writer"`` (W_O, W_2)."""
    if not config.subspace_rank:
        return {}
    names = {"embed.weight": "rows"}
    for i in range(config.constrained_layers):
        names[f"blocks.{i}.attn.wo.weight"] = "writer"
        names[f"blocks.{i}.ffn.w2.weight"] = "writer"
    return names


class SubspaceConstraint:
    """Re-projects variant A's constrained parameters into span(U) after every inner optimizer step.

    The model applies U·Uᵀ to the embedding and the writers in its forward pass (``ModelConfig.subspace_rank``),
    so its function is the constrained one for any stored weights: the global model right after a sparse outer
    step is the projection of what was applied, computed identically by every peer, and gradients reach the
    constrained tensors already projected, so a pipeline replica and a full replica see the same gradients and
    AdamW moments. The stored tensors keep whatever lies outside span(U); no model uses it. What this class adds
    is bookkeeping: after each inner step it keeps the change of each constrained tensor since the last
    synchronization inside span(U) (W ← W_sync + U·Uᵀ·(W − W_sync), embedding rows likewise), so weight decay
    and AdamW's per-coordinate steps move nothing outside the subspace, and a pseudo-gradient never carries
    off-span changes that every peer's projection would discard anyway.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], config: ModelConfig) -> None:
        names = constrained_names(config)
        self.targets = {n: (p, names[n]) for n, p in params.items() if n in names}
        self.basis = subspace_basis(config.d_model, config.subspace_rank, config.subspace_seed)
        self.refs: dict[str, torch.Tensor] = {}
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Remember the synchronized values: call after loading the global parameters of an outer step."""
        self.refs = {n: p.detach().clone() for n, (p, _) in self.targets.items()}

    @torch.no_grad()
    def reproject(self) -> None:
        """Project each constrained tensor's change since :meth:`sync` onto span(U); call after every step."""
        for name, (p, side) in self.targets.items():
            ref = self.refs[name]
            change = p - ref
            p.copy_(ref + (project_rows(change, self.basis) if side == "rows" else project_writer(change, self.basis)))


# --- codecs -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecConfig:
    """The activation codec of a run's stage boundaries; the run manifest names it."""

    kind: str = "dense"  # dense, subspace-a, subspace-b or subspace-a-drift
    rank: str = "1/32"  # k for subspace codecs: a ratio of d_model ("1/32") or an absolute count ("4")
    wire_dtype: str | None = None  # fp32, bf16, fp16 or fp64; None: bf16 for dense, fp32 (lossless A) otherwise
    seed: int = 0  # run seed: U and T_fixed come from it
    table_std: float = 1.0  # std of T_fixed's entries (variants A)
    out_gain: float = 1.0  # fixed gain of the norm on constrained sublayers' outputs (variants A)

    def __post_init__(self) -> None:
        if self.kind not in CODEC_KINDS:
            raise UserInputError(f"activation codec must be one of {', '.join(CODEC_KINDS)}, got {self.kind!r}")
        if self.wire_dtype not in (None, "fp32", "bf16", "fp16", "fp64"):
            raise UserInputError(f"activation wire dtype must be fp32, bf16, fp16 or fp64, got {self.wire_dtype!r}")

    @property
    def dtype(self) -> str:
        return self.wire_dtype or ("bf16" if self.kind == "dense" else "fp32")

    def k(self, d_model: int) -> int:
        return d_model if self.kind == "dense" else resolve_rank(self.rank, d_model)

    def label(self, d_model: int) -> str:
        if self.kind == "dense":
            return f"dense {self.dtype}"
        return f"{SHORT_NAMES[self.kind]} k={self.k(d_model)} {self.dtype}"


def _per_direction() -> dict[str, float]:
    return {"forward": 0, "backward": 0}


@dataclass
class LinkMeter:
    """What crossed one boundary, per direction ("forward", "backward"): frames, bytes, tokens, codec time."""

    frames: dict[str, float] = field(default_factory=_per_direction)
    bytes: dict[str, float] = field(default_factory=_per_direction)
    tokens: dict[str, float] = field(default_factory=_per_direction)
    encode_s: dict[str, float] = field(default_factory=_per_direction)
    decode_s: dict[str, float] = field(default_factory=_per_direction)

    def add(self, direction: str, nbytes: int, tokens: int, encode_s: float, decode_s: float) -> None:
        self.frames[direction] += 1
        self.bytes[direction] += nbytes
        self.tokens[direction] += tokens
        self.encode_s[direction] += encode_s
        self.decode_s[direction] += decode_s

    def bytes_per_token(self, direction: str) -> float:
        return self.bytes[direction] / self.tokens[direction] if self.tokens[direction] else 0.0

    def summary(self) -> dict[str, float]:
        out = {}
        for d in ("forward", "backward"):
            out[f"{d}_bytes_per_token"] = self.bytes_per_token(d)
            out[f"{d}_bytes"] = self.bytes[d]
            out[f"{d}_frames"] = self.frames[d]
            out[f"{d}_codec_s"] = self.encode_s[d] + self.decode_s[d]
        return out


@dataclass
class Received:
    """A decoded frame: the tensor the receiving side uses, the token ids that came with it, the sender's tag."""

    tensor: torch.Tensor  # [batch, seq, d_model] hidden states (forward) or activation-gradients (backward)
    token_ids: torch.Tensor | None
    tag: int


class _Link(torch.autograd.Function):
    """Identity-like map whose forward and backward each go through the codec's bytes, as a real link would."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, token_ids: torch.Tensor, codec: ActivationCodec) -> torch.Tensor:  # type: ignore[override]
        shape = (h.shape[0], h.shape[1])
        t0 = time.perf_counter()
        data = codec.encode_forward(h, token_ids)
        t1 = time.perf_counter()
        out = codec.decode_forward(data, shape).tensor
        codec.meter.add("forward", len(data), shape[0] * shape[1], t1 - t0, time.perf_counter() - t1)
        ctx.codec, ctx.shape = codec, shape
        return out.to(h.device, h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        codec, shape = ctx.codec, ctx.shape
        t0 = time.perf_counter()
        data = codec.encode_backward(grad)
        t1 = time.perf_counter()
        out = codec.decode_backward(data, shape).tensor
        codec.meter.add("backward", len(data), shape[0] * shape[1], t1 - t0, time.perf_counter() - t1)
        return out.to(grad.device, grad.dtype), None, None


class ActivationCodec(nn.Module, ABC):
    """One stage boundary's codec. ``codec(h, token_ids)`` is the in-process link; the byte methods are the wire.

    ``max_tokens`` and ``max_seq_len`` bound what a receiver accepts in one frame.
    """

    def __init__(
        self, d_model: int, width: int, wire_dtype: str, vocab_size: int | None, max_seq_len: int, max_tokens: int
    ) -> None:
        super().__init__()
        self.d_model, self.width, self.wire_dtype, self.vocab_size = d_model, width, wire_dtype, vocab_size
        self.forward_spec = ActivationSpec("forward", width, wire_dtype, vocab_size, max_tokens, max_seq_len)
        self.backward_spec = ActivationSpec("backward", width, wire_dtype, None, max_tokens, max_seq_len)
        self.meter = LinkMeter()

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, seq, d_model] as the next stage receives them; gradients flow back compressed."""
        return _Link.apply(h, token_ids, self)

    @abstractmethod
    def encode_forward(self, h: torch.Tensor, token_ids: torch.Tensor, tag: int = 0) -> bytes:
        """Sender side: the frame that carries hidden states ``h`` of tokens ``token_ids`` to the next stage."""

    @abstractmethod
    def decode_forward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        """Receiver side: hidden states [batch, seq, d_model] from an untrusted frame (ProtocolError if bad)."""

    @abstractmethod
    def encode_backward(self, grad: torch.Tensor, tag: int = 0) -> bytes:
        """Receiver side: the frame that carries dL/dh [batch, seq, d_model] back to the sender."""

    @abstractmethod
    def decode_backward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        """Sender side: dL/dh of its own output from an untrusted frame (ProtocolError if bad)."""

    def frame_bytes(self, tokens: int) -> dict[str, float]:
        """Bytes per token each way for frames of ``tokens`` tokens (header amortised), from the wire format."""
        per = self.width * element_size(self.wire_dtype)
        ids = self.forward_spec.id_size
        return {"forward": per + ids + HEADER_SIZE / tokens, "backward": per + HEADER_SIZE / tokens}

    def rebuild_table(self, embed: torch.Tensor) -> bool:
        """Rebuild T_fixed from the synchronized embedding ``embed`` after an outer step, for the codecs whose
        table follows it (B, A+drift); returns whether this codec has such a table (dense and A: no, nothing
        changes)."""
        return False


class DenseCodec(ActivationCodec):
    """d_model values per token each way in the wire dtype; no token ids travel."""

    def __init__(self, d_model: int, wire_dtype: str = "bf16", max_seq_len: int = 1 << 16,
                 max_tokens: int = 1 << 20) -> None:
        super().__init__(d_model, d_model, wire_dtype, None, max_seq_len, max_tokens)

    def encode_forward(self, h: torch.Tensor, token_ids: torch.Tensor, tag: int = 0) -> bytes:
        return encode_activations(h, "forward", self.wire_dtype, tag=tag)

    def decode_forward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        frame = decode_activations(data, self.forward_spec, shape)
        return Received(frame.values, None, frame.tag)

    def encode_backward(self, grad: torch.Tensor, tag: int = 0) -> bytes:
        return encode_activations(grad, "backward", self.wire_dtype, tag=tag)

    def decode_backward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        frame = decode_activations(data, self.backward_spec, shape)
        return Received(frame.values, None, frame.tag)


def _finite(t: torch.Tensor, direction: str) -> torch.Tensor:
    """``t``, or ProtocolError when decoding a frame of finite values overflowed (values near the float max)."""
    if not bool(torch.isfinite(t).all()):
        raise ProtocolError(f"{direction} subspace frame decodes to NaN or inf (its values are too large)")
    return t


class SubspaceCodec(ActivationCodec):
    """k values per token each way plus the token ids forward (ALGORITHMS.md §3); see the module docstring.

    ``table`` is T_fixed [vocab_size, d_model]; the pipeline replaces it with :meth:`set_table` (or
    :meth:`rebuild_table`, from the synchronized embedding and ``base``, the seed's table of the variants A) after
    every outer step for the variants that rebuild it (B, A+drift).
    """

    def __init__(self, variant: str, basis: torch.Tensor, table: torch.Tensor, wire_dtype: str = "fp32",
                 max_seq_len: int = 1 << 16, max_tokens: int = 1 << 20, base: torch.Tensor | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        d_model, k = basis.shape
        if table.dim() != 2 or table.shape[1] != d_model:
            raise ValueError(f"T_fixed must be [vocab, {d_model}], got {tuple(table.shape)}")
        super().__init__(d_model, k, wire_dtype, table.shape[0], max_seq_len, max_tokens)
        self.variant = variant
        self.base = base  # the seed's T_fixed (A+drift builds its table on it); a plain attribute, kept where it is
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("table", table, persistent=False)

    @torch.no_grad()
    def set_table(self, table: torch.Tensor) -> None:
        """Replace T_fixed (same shape); every peer must do so with the same values at the same time."""
        if table.shape != self.table.shape:
            raise ValueError(f"T_fixed must keep shape {tuple(self.table.shape)}, got {tuple(table.shape)}")
        self.table = table.detach().to(self.table.device, self.table.dtype)

    @torch.no_grad()
    def rebuild_table(self, embed: torch.Tensor) -> bool:
        if self.variant not in REBUILT:
            return False
        self.set_table(anchor_table(self.variant, self.base, embed.detach(), self.basis))
        return True

    def table_digest(self) -> str:
        """sha256 of T_fixed's float32 bytes: two peers with equal digests decode each other's frames alike."""
        return hashlib.sha256(self.table.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        # at least float32: variant A is only lossless if the subtraction of T_fixed[x] loses nothing under autocast
        return x.detach().to(self.basis.device, torch.float64 if x.dtype == torch.float64 else torch.float32)

    def compress(self, h: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """c = (h − T_fixed[x])·U, k values per token."""
        h = self._math(h)
        return (h - self.table.to(h.dtype)[token_ids.to(self.table.device)]) @ self.basis.to(h.dtype)

    def expand(self, c: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """h = c·Uᵀ + T_fixed[x]."""
        return c @ self.basis.to(c.dtype).T + self.table.to(c.dtype)[token_ids]

    def encode_forward(self, h: torch.Tensor, token_ids: torch.Tensor, tag: int = 0) -> bytes:
        return encode_activations(self.compress(h, token_ids), "forward", self.wire_dtype, token_ids,
                                  self.vocab_size, tag)

    def decode_forward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        frame = decode_activations(data, self.forward_spec, shape)
        if frame.token_ids is None:  # unreachable: the forward spec demands ids
            raise ProtocolError("subspace activation frame without token ids")
        ids = frame.token_ids.to(self.basis.device)
        return Received(_finite(self.expand(frame.values.to(self.basis.device), ids), "forward"), ids, frame.tag)

    def encode_backward(self, grad: torch.Tensor, tag: int = 0) -> bytes:
        g = self._math(grad)
        return encode_activations(g @ self.basis.to(g.dtype), "backward", self.wire_dtype, tag=tag)

    def decode_backward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        frame = decode_activations(data, self.backward_spec, shape)
        v = frame.values.to(self.basis.device)
        return Received(_finite(v @ self.basis.to(v.dtype).T, "backward"), None, frame.tag)


def make_codec(
    cfg: CodecConfig,
    d_model: int,
    vocab_size: int,
    max_seq_len: int,
    base_table: torch.Tensor | None = None,
    embed: torch.Tensor | None = None,
    max_tokens: int = 1 << 20,
) -> ActivationCodec:
    """The codec ``cfg`` names for one boundary; subspace codecs start from :func:`anchor_table`.

    ``base_table`` is the seed table T_fixed (variants A; built here when omitted); ``embed`` the current
    synchronized embedding (B and A+drift; required).
    """
    if cfg.kind == "dense":
        return DenseCodec(d_model, cfg.dtype, max_seq_len, max_tokens)
    k = cfg.k(d_model)
    basis = subspace_basis(d_model, k, cfg.seed)
    if cfg.kind in CONSTRAINED and base_table is None:
        base_table = fixed_table(vocab_size, d_model, cfg.seed, cfg.table_std)
    if cfg.kind == "subspace-a":
        table = base_table
    elif embed is None:
        raise ValueError(f"codec {cfg.kind} needs the synchronized embedding to build T_fixed")
    else:
        table = anchor_table(cfg.kind, base_table, embed, basis)
    return SubspaceCodec(cfg.kind, basis, table, cfg.dtype, max_seq_len, max_tokens, base_table)


def constrained_model_config(base: ModelConfig, cfg: CodecConfig, constrained_layers: int) -> ModelConfig:
    """The model a run with codec ``cfg`` trains: ``base`` itself, or for variants A the constrained network.

    ``constrained_layers`` is the first layer of the last stage: blocks before it must write only into span(U),
    the last stage's blocks may stay free (ALGORITHMS.md §3).
    """
    if cfg.kind not in CONSTRAINED:
        return base
    return base.replace(
        subspace_rank=cfg.k(base.d_model),
        subspace_layers=constrained_layers,
        subspace_seed=cfg.seed,
        subspace_table_std=cfg.table_std,
        subspace_out_gain=cfg.out_gain,
        subspace_drift=cfg.kind == "subspace-a-drift",
    )
