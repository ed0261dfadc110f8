"""Dense tensor payloads (DiLoCo's pseudo-gradients, dense activations): safetensors bytes, validated on decode.

safetensors has an explicit JSON header and no code execution, so it is safe to parse; what it does not know is
what the receiver expects. :func:`read_header` checks the JSON header (sizes, dtypes, shapes, offsets) with the
standard library before safetensors or torch see the bytes, so a dtype torch lacks or a shape whose size
overflows is refused without allocating; ``decode_dense`` then checks names, shapes, dtype and finiteness against
what the receiver expects, and turns every defect into :class:`ProtocolError`. State sync and the checkpoint loader
reuse :func:`read_header`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hlbp.protocol.errors import ProtocolError

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_HEADER_BYTES = 1 << 20  # a header this large would describe tens of thousands of tensors
ST_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
"""safetensors' name of each wire dtype."""
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""safetensors dtypes that torch loads everywhere, with their bytes per value; anything else is refused."""
MAX_DIMS = 8
MAX_DIM = 1 << 40
_ST_KEYS = {"dtype", "shape", "data_offsets"}


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("safetensors header repeats a tensor name")
    return out


def read_header(
    data: bytes, max_header: int = MAX_HEADER_BYTES, dtypes: Mapping[str, int] = ST_ITEMSIZE, what: str = "payload",
    total_size: int | None = None,
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Validate the safetensors header of untrusted ``data``: ``{name: (dtype, shape)}``, or ProtocolError.

    Checks, before anything is allocated at a size the header claims: the header length against ``max_header``
    and the data, JSON syntax (no duplicate names, bounded nesting), every dtype against ``dtypes`` (safetensors
    name -> bytes per value), shapes (at most 8 non-negative dims), and that the data offsets tile the rest of
    ``data`` exactly, in order, with each tensor's byte size equal to its shape's. ``what`` names the input.
    ``total_size`` is the length of the whole input when ``data`` holds only its beginning (a file's header).
    """
    total = len(data) if total_size is None else total_size
    if len(data) < 8:
        raise ProtocolError(f"{what} is truncated (no safetensors header)")
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if header_len > max_header or 8 + header_len > min(len(data), total):
        raise ProtocolError(f"{what}: safetensors header length {header_len} is out of bounds")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=_unique_keys)
    except ProtocolError as exc:
        raise ProtocolError(f"{what}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"{what}: safetensors header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"{what}: safetensors header must be a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ProtocolError(f"{what}: safetensors metadata must map strings to strings")
    out, spans = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != _ST_KEYS:
            raise ProtocolError(f"{what}: tensor {name[:60]!r} needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in dtypes:
            raise ProtocolError(f"{what}: tensor {name[:60]!r} has dtype {str(dtype)[:16]!r}, accepted: "
                                f"{', '.join(sorted(dtypes))}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
            raise ProtocolError(f"{what}: tensor {name[:60]!r} shape must be at most {MAX_DIMS} dims in 0..2**40")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int and o >= 0 for o in offsets)):
            raise ProtocolError(f"{what}: tensor {name[:60]!r} data_offsets must be two non-negative integers")
        if offsets[1] - offsets[0] != math.prod(shape) * dtypes[dtype]:
            raise ProtocolError(f"{what}: tensor {name[:60]!r} data_offsets do not match its shape and dtype")
        out[name] = (dtype, tuple(shape))
        spans.append((offsets[0], offsets[1]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ProtocolError(f"{what}: safetensors data offsets overlap or leave gaps")
        end = stop
    if 8 + header_len + end != total:
        raise ProtocolError(f"{what}: safetensors data is {total - 8 - header_len} bytes, the header says {end}")
    return out


def header_bound(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Upper bound on the safetensors header :func:`encode_dense` writes for these tensors (8-byte prefix too)."""
    return 64 + sum(len(json.dumps(name)) + 96 + 21 * len(shape) for name, shape in shapes.items())


def dense_max_size(shapes: Mapping[str, tuple[int, ...]], wire_dtype: str) -> int:
    """Largest dense payload a receiver expecting ``shapes`` in ``wire_dtype`` needs to accept."""
    return dense_size(dict(shapes), wire_dtype) + header_bound(shapes)


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
    limit = max_bytes if max_bytes is not None else dense_max_size(expected, wire_dtype)
    if len(data) > limit:
        raise ProtocolError(f"dense payload of {len(data)} bytes exceeds the limit of {limit}")
    st_dtype = ST_DTYPES[wire_dtype]
    header = read_header(data, min(MAX_HEADER_BYTES, limit), {st_dtype: ST_ITEMSIZE[st_dtype]}, "dense payload")
    if set(header) != set(expected):
        missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
        raise ProtocolError(f"dense payload names differ from the shard: missing {missing[:3]}, extra "
                            f"{[n[:60] for n in extra[:3]]}")
    for name, (_, shape) in header.items():
        if shape != tuple(expected[name]):
            raise ProtocolError(f"dense tensor {name!r} has shape {shape}, expected {tuple(expected[name])}")
    try:
        tensors = st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise ProtocolError(f"dense payload is not valid safetensors: {exc}") from None
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
