"""Activation codecs of pipeline stage boundaries: what every codec is (an ``nn.Module`` whose forward and backward
go through the real wire bytes), the dense codec, and the meter of the bytes each link carries.

The subspace codecs, their anchor tables and the constrained network of variant A are in
:mod:`hlbp.peer.model.subspace`; :func:`hlbp.peer.model.subspace.make_codec` builds either kind from a
:class:`CodecConfig`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.basis import resolve_rank
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
SHORT_NAMES = {"dense": "dense", "subspace-a": "A", "subspace-b": "B", "subspace-a-drift": "A+drift"}
"""Labels for tables."""


# --- links and the dense codec -------------------------------------------------------------------------------------------------------


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


def check_finite(t: torch.Tensor, direction: str) -> torch.Tensor:
    """``t``, or ProtocolError when decoding a frame of finite values overflowed (values near the float max)."""
    if not bool(torch.isfinite(t).all()):
        raise ProtocolError(f"{direction} subspace frame decodes to NaN or inf (its values are too large)")
    return t
