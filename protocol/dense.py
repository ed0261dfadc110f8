"""Dense tensor payloads (DiLoCo's pseudo-gradients, dense activations): safetensors bytes, validated on decode.

safetensors has an explicit JSON header and no code execution, so it is safe to parse; what it does not know is
what the receiver expects. ``decode_dense`` checks names, shapes, dtype and finiteness against that, and turns
every defect into :class:`ProtocolError`.
"""

from __future__ import annotations

import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hlbp.protocol.errors import ProtocolError

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_HEADER_BYTES = 1 << 20  # a header this large would describe tens of thousands of tensors


def encode_dense(tensors: dict[str, torch.Tensor], wire_dtype: str = "fp32") -> bytes:
    """Serialise named tensors in ``wire_dtype`` (fp32, bf16 or fp16)."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
    dtype = WIRE_DTYPES[wire_dtype]
    return st_save({n: t.detach().to("cpu", dtype).contiguous() for n, t in tensors.items()})


def dense_size(shapes: dict[str, tuple[int, ...]], wire_dtype: str) -> int:
    """Body bytes of the tensor data alone, without the safetensors header."""
    per = torch.empty(0, dtype=WIRE_DTYPES[wire_dtype]).element_size()
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n * per
    return total


def decode_dense(
    data: bytes, expected: dict[str, tuple[int, ...]], wire_dtype: str, max_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """Parse untrusted bytes into float32 tensors that match ``expected`` names and shapes exactly."""
    if wire_dtype not in WIRE_DTYPES:
        raise ProtocolError(f"unknown dense wire dtype {wire_dtype!r}")
    limit = max_bytes if max_bytes is not None else dense_size(expected, wire_dtype) + MAX_HEADER_BYTES
    if len(data) > limit:
        raise ProtocolError(f"dense payload of {len(data)} bytes exceeds the limit of {limit}")
    if len(data) < 8:
        raise ProtocolError("dense payload is truncated (no safetensors header)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise ProtocolError(f"dense payload header length {header_len} is out of bounds")
    try:
        tensors = st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ProtocolError(f"dense payload is not valid safetensors: {exc}") from None
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ProtocolError(f"dense payload names differ from the shard: missing {missing[:3]}, extra {extra[:3]}")
    dtype = WIRE_DTYPES[wire_dtype]
    out = {}
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise ProtocolError(f"dense tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != tuple(expected[name]):
            raise ProtocolError(f"dense tensor {name!r} has shape {tuple(t.shape)}, expected {expected[name]}")
        t32 = t.float()
        if not bool(torch.isfinite(t32).all()):
            raise ProtocolError(f"dense tensor {name!r} contains NaN or inf")
        out[name] = t32
    return out
