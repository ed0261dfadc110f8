"""Wire format of what crosses a pipeline stage boundary: activations forward, activation-gradients backward.

One frame per micro-batch and direction, all integers little-endian::

    magic    4s   b"HLBA"
    version  u8   1
    kind     u8   0 = forward activations, 1 = backward activation-gradients
    dtype    u8   0 = fp32, 1 = bf16, 2 = fp16, 3 = fp64
    id_size  u8   bytes per token id: 0 (no ids travel), 2 (vocabularies up to 65,536) or 4
    tag      u64  micro-batch id chosen by the sender; the gradient that answers a forward frame carries it back
    batch    u32  sequences in the micro-batch
    seq      u32  tokens per sequence
    width    u32  values per token: d_model for a dense codec, k for a subspace codec
    values   batch * seq * width values of ``dtype``, row-major
    ids      batch * seq token ids, unsigned, ``id_size`` bytes each

A fixed binary header rather than msgpack: pipeline neighbours exchange one frame per micro-batch on a long-lived
stream, and 28 bytes parsed with one ``struct.unpack`` cost nothing next to the values. The receiver never trusts
a size from the frame: :class:`ActivationSpec` (from the run manifest and the stage's own shapes) fixes kind,
dtype, width, id size and the token budget, and the frame must have exactly the length they imply.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from hlbp.protocol.errors import ProtocolError

MAGIC = b"HLBA"
"""First four bytes of every activation frame."""
VERSION = 1
"""Version of the frame layout above."""
HEADER = struct.Struct("<4sBBBBQIII")
HEADER_SIZE = HEADER.size
"""Bytes before the values: 28."""
KINDS = ("forward", "backward")
"""Frame kinds, by their code."""
WIRE_DTYPES = ("fp32", "bf16", "fp16", "fp64")
"""Value dtypes, by their code."""
_NP_DTYPES = {"fp32": "<f4", "bf16": "<u2", "fp16": "<f2", "fp64": "<f8"}  # bf16 travels as its raw 16 bits
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
_ID_DTYPES = {2: "<u2", 4: "<u4"}
MAX_U32 = 2**32 - 1


def element_size(wire_dtype: str) -> int:
    """Bytes per value of ``wire_dtype``."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
    return np.dtype(_NP_DTYPES[wire_dtype]).itemsize


def id_size_for(vocab_size: int | None) -> int:
    """Bytes per token id for a vocabulary: 0 when no ids travel, else the smallest of 2 and 4 that fits."""
    if vocab_size is None:
        return 0
    if not 1 <= vocab_size <= MAX_U32 + 1:
        raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    return 2 if vocab_size <= 1 << 16 else 4


def frame_size(batch: int, seq: int, width: int, wire_dtype: str, id_size: int) -> int:
    """Exact bytes of a frame: header, values and ids."""
    tokens = batch * seq
    return HEADER_SIZE + tokens * (width * element_size(wire_dtype) + id_size)


@dataclass(frozen=True)
class ActivationSpec:
    """What a receiver accepts at one boundary and direction; every field bounds untrusted input."""

    kind: str  # "forward" or "backward"
    width: int  # values per token the sender's codec must use (d_model or k)
    wire_dtype: str  # the run's wire dtype for this codec
    vocab_size: int | None = None  # token ids must travel, each below this; None: no ids may travel
    max_tokens: int = 1 << 20  # largest batch * seq accepted
    max_seq_len: int = 1 << 16  # longest sequence accepted

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if not 1 <= self.width <= MAX_U32 or self.max_tokens < 1 or self.max_seq_len < 1:
            raise ValueError("width, max_tokens and max_seq_len must be positive")
        id_size_for(self.vocab_size)

    @property
    def id_size(self) -> int:
        return id_size_for(self.vocab_size)


@dataclass
class ActivationFrame:
    """A decoded frame. ``values`` is float32 ([batch, seq, width]), or float64 for an fp64 frame."""

    kind: str
    tag: int
    values: torch.Tensor
    token_ids: torch.Tensor | None  # int64 [batch, seq], or None when no ids travelled


def encode_activations(
    values: torch.Tensor,
    kind: str,
    wire_dtype: str,
    token_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
    tag: int = 0,
) -> bytes:
    """One frame from ``values`` [batch, seq, width] and, for a subspace codec, ``token_ids`` [batch, seq].

    ``vocab_size`` fixes the id width and must be given exactly when ids are; values are cast to ``wire_dtype``.
    Raises ValueError for input that a receiver would reject, so a bad frame fails at the sender.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
    if values.dim() != 3:
        raise ValueError(f"values must be [batch, seq, width], got shape {tuple(values.shape)}")
    batch, seq, width = values.shape
    if min(batch, seq, width) < 1 or max(batch, seq, width) > MAX_U32 or not 0 <= tag < 2**64:
        raise ValueError(f"frame dimensions {tuple(values.shape)} or tag {tag} out of range")
    if (token_ids is None) != (vocab_size is None):
        raise ValueError("token_ids and vocab_size go together")
    id_size = id_size_for(vocab_size)
    head = HEADER.pack(MAGIC, VERSION, KINDS.index(kind), WIRE_DTYPES.index(wire_dtype), id_size, tag, batch, seq,
                       width)
    v = values.detach().to("cpu", _TORCH_DTYPES[wire_dtype]).contiguous()
    arr = v.view(torch.int16).numpy().view(np.uint16) if wire_dtype == "bf16" else v.numpy()
    parts = [head, arr.astype(_NP_DTYPES[wire_dtype], copy=False).tobytes()]
    if token_ids is not None:
        ids = token_ids.detach().to("cpu", torch.int64)
        if tuple(ids.shape) != (batch, seq):
            raise ValueError(f"token_ids shape {tuple(ids.shape)} does not match values {(batch, seq)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):  # type: ignore[operator]
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        parts.append(ids.numpy().astype(_ID_DTYPES[id_size]).tobytes())
    return b"".join(parts)


def decode_activations(
    data: bytes, spec: ActivationSpec, shape: tuple[int, int] | None = None
) -> ActivationFrame:
    """Parse an untrusted frame that must satisfy ``spec`` and, when given, carry exactly ``shape`` = (batch, seq).

    Checks magic, version, kind, dtype, id size, width, token budget, exact length, token-id range and finiteness;
    every defect raises :class:`ProtocolError`.
    """
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"activation frame of {len(data)} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, kind, dtype, id_size, tag, batch, seq, width = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError("not an activation frame (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"activation frame version {version} is not supported (this peer speaks {VERSION})")
    if kind >= len(KINDS) or KINDS[kind] != spec.kind:
        raise ProtocolError(f"activation frame kind {kind} where a {spec.kind} frame was expected")
    if dtype >= len(WIRE_DTYPES) or WIRE_DTYPES[dtype] != spec.wire_dtype:
        raise ProtocolError(f"activation frame dtype code {dtype}, the run uses {spec.wire_dtype}")
    if id_size != spec.id_size:
        raise ProtocolError(f"activation frame carries {id_size}-byte token ids, expected {spec.id_size}")
    if width != spec.width:
        raise ProtocolError(f"activation frame has {width} values per token, the codec uses {spec.width}")
    if batch < 1 or seq < 1 or seq > spec.max_seq_len or batch * seq > spec.max_tokens:
        raise ProtocolError(
            f"activation frame of {batch} x {seq} tokens is outside the limits "
            f"(seq <= {spec.max_seq_len}, tokens <= {spec.max_tokens})"
        )
    if shape is not None and (batch, seq) != tuple(shape):
        raise ProtocolError(f"activation frame is {batch} x {seq} tokens, expected {shape[0]} x {shape[1]}")
    wire = WIRE_DTYPES[dtype]
    expected = frame_size(batch, seq, width, wire, id_size)
    if len(data) != expected:
        raise ProtocolError(f"activation frame has {len(data)} bytes, its header implies {expected}")
    n = batch * seq
    raw = np.frombuffer(data, dtype=_NP_DTYPES[wire], count=n * width, offset=HEADER_SIZE)
    if wire == "bf16":
        values = torch.from_numpy(raw.astype("=u2").view(np.int16)).view(torch.bfloat16).float()
    else:
        values = torch.from_numpy(raw.astype(raw.dtype.newbyteorder("="), copy=True))
        values = values.double() if wire == "fp64" else values.float()
    if not bool(torch.isfinite(values).all()):
        raise ProtocolError("activation frame contains NaN or inf")
    token_ids = None
    if id_size:
        offset = HEADER_SIZE + n * width * element_size(wire)
        ids = np.frombuffer(data, dtype=_ID_DTYPES[id_size], count=n, offset=offset).astype(np.int64)
        if n and int(ids.max()) >= spec.vocab_size:  # type: ignore[operator]
            raise ProtocolError(f"activation frame has a token id {int(ids.max())} outside the vocabulary "
                                f"of {spec.vocab_size}")
        token_ids = torch.from_numpy(ids).view(batch, seq)
    return ActivationFrame(KINDS[kind], tag, values.view(batch, seq, width), token_ids)
