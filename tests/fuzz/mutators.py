"""Structure-aware mutations for the decoder fuzzer: msgpack trees, safetensors headers, zstd frames, raw bytes.

A mutation works *inside* the structure a real encoder produced: it decodes the valid input, changes one node
(type, size, value, nesting, duplicates, non-canonical encodings), and encodes again, so the decoder under test
gets past its framing and into its deep checks. :class:`Raw` splices hand-made msgpack bytes into a tree (deep
nesting, duplicate keys, non-minimal integers, float32) that ``msgpack.packb`` would never write.
"""

from __future__ import annotations

import json
import math
import random
import struct
from typing import Any

import msgpack
import zstandard

EDGE_INTS = [0, 1, -1, 2, 255, 256, 4095, 4096, 4097, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**48,
             2**62, 2**63 - 1, -(2**63), 2**64 - 1, -(2**31)]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 1e38, 3.4e38, -3.4e38, 1e308, -0.0, 5e-324, 1e-45, 0.5]
EDGE_STRS = ["", "\n", "00", "01", "²", "٣", "+1", " 1", "1\n", "a" * 300, "a" * 70, "ef.x", "momentum.x",
             "12D3KooW" + "A" * 44 + "\n", "f" * 64 + "\n", "run\n", "zstd", "raw", "packed12", "entropy", "dense-fp32"]


class Raw:
    """Pre-encoded msgpack bytes to splice into a tree in place of a value."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def pack_tree(tree: Any) -> bytes:
    """``msgpack.packb`` of ``tree``, with every :class:`Raw` node replaced by its bytes."""
    raws: list[bytes] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.data)
            return b"\x00\xffRAW%08d\xff\x00" % (len(raws) - 1)
        if isinstance(node, list):
            return [swap(x) for x in node]
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, int) and not isinstance(node, bool) and not -(2**63) <= node < 2**64:
            return 2**64 - 1 if node > 0 else -(2**63)  # msgpack holds 64-bit integers only
        return node

    out = msgpack.packb(swap(tree), use_bin_type=True)
    for i, data in enumerate(raws):
        out = out.replace(msgpack.packb(b"\x00\xffRAW%08d\xff\x00" % i, use_bin_type=True), data)
    return out


def deep_nesting(depth: int, kind: str = "array") -> Raw:
    """``depth`` nested one-element arrays (or maps) around nil: msgpack bytes no encoder here would write."""
    if kind == "map":
        return Raw(b"\x81\xa1k" * depth + b"\xc0")
    return Raw(b"\x91" * depth + b"\xc0")


def noncanonical_int(value: int) -> Raw:
    """``value`` (>= 0) encoded as uint64: a valid but non-minimal msgpack integer."""
    return Raw(b"\xcf" + struct.pack(">Q", value % 2**64))


def float32(value: float) -> Raw:
    """``value`` as a msgpack float32 (infinite when too large): float64 is the canonical form."""
    if math.isfinite(value) and abs(value) > 3.4e38:
        value = math.copysign(math.inf, value)
    return Raw(b"\xca" + struct.pack(">f", value))


def dup_map(pairs: list[tuple[Any, Any]]) -> Raw:
    """A msgpack map holding ``pairs`` verbatim, repeated keys included."""
    body = b"".join(pack_tree(k) + pack_tree(v) for k, v in pairs)
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return Raw(head + body)


def flip_bytes(rng: random.Random, data: bytes, n: int | None = None) -> bytes:
    """Classic byte-level damage: flips, truncation, extension, splices, copies."""
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:
        for _ in range(n or rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:
        b = b[: rng.randrange(len(b) + 1)]
    elif op == 2:
        b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 8, 100])))
    elif op == 3 and b:
        i = rng.randrange(len(b))
        b[i] = rng.choice([0, 0xFF, 0x7F, 0x80])
    elif op == 4 and b:
        i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        b = b[:i] + b[j:]
    elif b:
        i = rng.randrange(len(b))
        b = b[:i] + b[i : i + rng.randint(1, 64)] + b[i:]
    return bytes(b)


def random_value(rng: random.Random) -> Any:
    """A value of random type, biased to edges: what a field's type or size is changed to."""
    op = rng.randrange(12)
    if op == 0:
        return rng.choice(EDGE_INTS)
    if op == 1:
        return rng.choice(EDGE_FLOATS)
    if op == 2:
        return rng.choice(EDGE_STRS)
    if op == 3:
        return rng.choice([None, True, False])
    if op == 4:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 20, 32, 64, 65, 300])))
    if op == 5:
        return [rng.choice(EDGE_INTS) for _ in range(rng.choice([0, 1, 2, 3, 4, 100]))]
    if op == 6:
        return {rng.choice(EDGE_STRS): rng.choice(EDGE_INTS) for _ in range(rng.choice([0, 1, 3]))}
    if op == 7:
        return deep_nesting(rng.choice([20, 500, 1000, 1100, 5000]), rng.choice(["array", "map"]))
    if op == 8:
        return noncanonical_int(rng.choice([0, 1, 7, 64, 2**32]))
    if op == 9:
        return float32(rng.choice([0.5, 1e38, math.inf]))
    if op == 10:
        return "x" * rng.choice([256, 257, 513, 5000, 40000])
    return rng.choice(EDGE_INTS) * rng.choice([1, -1])


def _paths(tree: Any) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    stack: list[tuple[Any, tuple[Any, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                out.append((*path, k))
                stack.append((v, (*path, k)))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                out.append((*path, i))
                stack.append((v, (*path, i)))
    return out


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def mutate_value(rng: random.Random, node: Any) -> Any:
    """A nearby or a foreign value for ``node``: type-preserving edits half the time, type changes otherwise."""
    if rng.random() < 0.5:
        return random_value(rng)
    if isinstance(node, bool):
        return not node
    if isinstance(node, int):
        return rng.choice([node + 1, node - 1, -node, node * 2**rng.randrange(1, 40), 0, rng.choice(EDGE_INTS),
                           noncanonical_int(abs(node))])
    if isinstance(node, float):
        return rng.choice([*EDGE_FLOATS, node * 1e30, -node, float32(node)])
    if isinstance(node, str):
        return rng.choice([node + "\n", node[:-1], node + node, "0" + node, node.upper(), "²", node[::-1]])
    if isinstance(node, bytes):
        return flip_bytes(rng, node)
    if isinstance(node, list):
        if node and rng.random() < 0.3:
            return node[:-1]
        if node and rng.random() < 0.5:
            return [*node, node[-1]]
        return [*node, random_value(rng)]
    if isinstance(node, dict):
        items = list(node.items())
        op = rng.randrange(4)
        if op == 0 and items:
            del node[rng.choice(items)[0]]
            return node
        if op == 1 and items:
            k, v = rng.choice(items)
            return dup_map([*items, (k, mutate_value(rng, v))])
        if op == 2:
            node[rng.choice(EDGE_STRS)] = random_value(rng)
            return node
        return dict(reversed(items))
    return random_value(rng)


def mutate_tree(rng: random.Random, tree: Any, n: int = 1) -> Any:
    """Change ``n`` random nodes of a decoded msgpack tree (in place where possible); returns the new tree."""
    for _ in range(n):
        paths = [p for p in _paths(tree) if not any(isinstance(x, Raw) for x in [tree])]
        path = rng.choice(paths)
        node = _get(tree, path)
        if isinstance(node, Raw):
            continue
        tree = _set(tree, path, mutate_value(rng, node))
        if isinstance(tree, Raw):
            break
    return tree


# --- zstd -----------------------------------------------------------------------------------------------------


def fcs_field(frame: bytes) -> tuple[int, int] | None:
    """(offset, width) of the frame-content-size field of a zstd frame header, or None when it has none."""
    if len(frame) < 6 or frame[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    width = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fcs_flag]
    if not width:
        return None
    offset = 5 + (0 if single else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[dict_flag]
    return offset, width


def lie_content_size(frame: bytes, size: int) -> bytes:
    """``frame`` with its declared content size replaced by ``size`` (as far as the field's width allows)."""
    field = fcs_field(frame)
    if field is None:
        return frame
    offset, width = field
    value = size - 256 if width == 2 else size
    value %= 256**width
    return frame[:offset] + value.to_bytes(width, "little") + frame[offset + width :]


def recompress(rng: random.Random, frame: bytes, max_out: int = 1 << 22) -> bytes:
    """Decompress a frame, mutate the content, compress again (sometimes declaring a lying size)."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max_out)
    except zstandard.ZstdError:
        raw = frame
    raw = flip_bytes(rng, raw) if rng.random() < 0.7 else raw + raw
    out = zstandard.ZstdCompressor(level=rng.choice([1, 3, 19]), write_content_size=True).compress(raw)
    if rng.random() < 0.3:
        out = lie_content_size(out, rng.choice([0, 1, len(raw) - 1, len(raw) + 1, 2**31, 2**40]))
    return out


_BOMBS: dict[int, bytes] = {}


def zstd_bomb(size: int = 1 << 30) -> bytes:
    """A valid zstd frame of ``size`` zero bytes (about 33 KB for 1 GiB), built in pieces to stay small here."""
    if size not in _BOMBS:
        import io

        sink = io.BytesIO()
        with zstandard.ZstdCompressor(level=1, write_content_size=True).stream_writer(
            sink, size=size, closefd=False
        ) as w:
            chunk = bytes(1 << 20)
            left = size
            while left:
                w.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
        _BOMBS[size] = sink.getvalue()
    return _BOMBS[size]


def zero_frame_then_garbage(rng: random.Random) -> bytes:
    """A zstd frame declaring content size 0, followed by bytes that should make any decoder refuse it."""
    return zstandard.ZstdCompressor(write_content_size=True).compress(b"") + flip_bytes(rng, b"garbage!" * 4)


# --- safetensors ------------------------------------------------------------------------------------------------

ST_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64", "F8_E4M3",
             "F8_E5M2", "C64", "F4", "E8M0", "f32", ""]


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header: Any, body: bytes, pad: bool = True) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def mutate_safetensors(rng: random.Random, data: bytes, names: list[str] | None = None) -> bytes:
    """Change one thing inside a safetensors blob: a dtype, a shape, offsets, names, values, metadata, the JSON."""
    header, body = split_safetensors(data)
    entries = [k for k in header if k != "__metadata__"]
    op = rng.randrange(12)
    name = rng.choice(entries) if entries else None
    if op == 0 and name:
        header[name]["dtype"] = rng.choice(ST_DTYPES)
    elif op == 1 and name:
        shape = header[name]["shape"]
        header[name]["shape"] = rng.choice([[2**62, 2**62], [2**64], [-1], [*shape, 1], shape[::-1], [],
                                            [0], [2**31, 2**31, 4], [1] * 40, [1.5], ["3"]])
    elif op == 2 and name:
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[a, b + 4], [a - 4, b], [0, 2**63], [b, a], [a], [-4, b],
                                                   [a, 2**64 + 8]])
    elif op == 3 and name:
        header[rng.choice([name + "\n", "o.ef." + name[2:], "o.momentum." + name[2:], "p.zzz", name.upper(),
                           *(names or [])])] = header.pop(name)
    elif op == 4 and body:
        # overwrite a 4-byte aligned value with NaN, inf, a huge finite float or a subnormal
        i = rng.randrange(max(1, len(body) // 4)) * 4
        word = rng.choice([struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", 3.4e38),
                           b"\xff\xff\xff\xff", b"\x00\x7f\x80\x7f"])
        body = body[:i] + word + body[i + 4 :]
    elif op == 5:
        header["__metadata__"] = rng.choice([{"a": 1}, {"a": "b"}, [], "x", {"format": ["deep"] * 3}])
    elif op == 6:
        return join_safetensors("[" * rng.choice([1000, 100_000]) + "]" * 3, body)
    elif op == 7:
        text = json.dumps(header)
        return join_safetensors(text[:-1] + ', "' + (name or "x") + '": ' + json.dumps(header.get(name)) + "}",
                                body)
    elif op == 8:
        return flip_bytes(rng, data)
    elif op == 9:
        return rng.choice([2**64 - 1, 2**40, 0, 7]).to_bytes(8, "little") + data[8:]
    elif op == 10 and name:
        header[name] = rng.choice([None, [], "x", {"dtype": "F32"}, {**header[name], "extra": 1}])
    else:
        body = flip_bytes(rng, body)
    return join_safetensors(header, body, pad=rng.random() < 0.9)
