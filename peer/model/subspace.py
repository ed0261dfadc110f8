"""Compression of pipeline stage boundaries into a subspace (docs/algorithms.md §3): the shared basis U, the anchor
table T_fixed, the subspace codecs, and the constraints of the exact subspace network (variant A). What every codec
is, and the dense codec, are in :mod:`hlbp.peer.model.codec`.

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
from collections.abc import Mapping

import torch
from torch import nn

from hlbp.peer.model.basis import (
    fixed_table,
    off_span,
    project_rows,
    project_writer,
    subspace_basis,
)
from hlbp.peer.model.codec import (
    ActivationCodec,
    CodecConfig,
    DenseCodec,
    Received,
    check_finite,
)
from hlbp.peer.model.decoder import ModelConfig
from hlbp.protocol import ProtocolError
from hlbp.protocol.activations import (
    decode_activations,
    encode_activations,
)

VARIANTS = ("subspace-a", "subspace-b", "subspace-a-drift")
"""The subspace codecs."""
CONSTRAINED = ("subspace-a", "subspace-a-drift")
"""Variants that run on the constrained model of docs/algorithms.md §3 (A)."""
REBUILT = ("subspace-b", "subspace-a-drift")
"""Variants whose T_fixed is a function of the synchronized embedding, rebuilt after every outer step."""


# --- variant-specific anchor tables -----------------------------------------------------------------------------


def drift_table(base: torch.Tensor, embed: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """T_⊥ under drift absorption: the seed table plus everything of the embedding outside span(U).

    Absorbing after every outer step (:func:`absorb_drift`) adds each step's off-span part of the embedding to
    T_⊥ and leaves T_S = embed·U·Uᵀ; summed over the run that is exactly this, so every peer gets T_⊥ from the
    seed and the synchronized embedding alone, with no history to keep or transfer.
    """
    return base + off_span(embed.to(base), basis)


def absorb_drift(t_perp: torch.Tensor, t_s: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One drift absorption as docs/algorithms.md §3 states it: P = T_S·U·Uᵀ; T_⊥ ← T_⊥ + (T_S − P); T_S ← P."""
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


# --- the subspace codec ---------------------------------------------------------------------------------------


class SubspaceCodec(ActivationCodec):
    """k values per token each way plus the token ids forward (docs/algorithms.md §3); see the module docstring.

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
        return Received(check_finite(self.expand(frame.values.to(self.basis.device), ids), "forward"), ids, frame.tag)

    def encode_backward(self, grad: torch.Tensor, tag: int = 0) -> bytes:
        g = self._math(grad)
        return encode_activations(g @ self.basis.to(g.dtype), "backward", self.wire_dtype, tag=tag)

    def decode_backward(self, data: bytes, shape: tuple[int, int] | None = None) -> Received:
        frame = decode_activations(data, self.backward_spec, shape)
        v = frame.values.to(self.basis.device)
        return Received(check_finite(v @ self.basis.to(v.dtype).T, "backward"), None, frame.tag)


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
    the last stage's blocks may stay free (docs/algorithms.md §3).
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
