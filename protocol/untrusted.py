"""Shared guards for decoding untrusted bytes: bounded, canonical msgpack, and safe previews of hostile values.

Every msgpack decoder of ``hlbp.protocol`` goes through :func:`unpack_msgpack`, so one set of rules holds for all:
the input is size-checked before parsing, msgpack's own per-container limits bound what a short input can claim,
extension types are refused, map keys must be unique, nesting is bounded, and the bytes must be exactly what
``msgpack.packb(value, use_bin_type=True)`` writes for the decoded value. The last rule makes the encoding
canonical: one value has one encoding, so a digest or signature over the bytes names the value and nothing else
(no non-minimal integers, no float32 for a float64, no str/bin swaps, no duplicate keys).
"""

from __future__ import annotations

from typing import Any

import msgpack

from hlbp.protocol.errors import ProtocolError

MAX_DEPTH = 8
"""Deepest container nesting any hlbp msgpack structure uses (the manifest's ``artifacts`` list of maps is 3)."""


def preview(value: Any, limit: int = 40) -> str:
    """A short, safe description of an untrusted value for an error message.

    ``str()`` of a hostile value can recurse (nested lists) or be huge; this looks only at scalars and otherwise
    names the type, so building an error message never fails or costs more than ``limit`` characters.
    """
    if isinstance(value, (bool, int, float)) or value is None:
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"<{value.bit_length()}-bit int>"
    elif isinstance(value, (str, bytes)):
        text = repr(value[:limit])
    else:
        text = f"<{type(value).__name__}>"
    return text[: limit + 2]


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not used by hlbp")


def _unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("msgpack map repeats a key")
    return out


def check_depth(value: Any, max_depth: int, what: str) -> None:
    """Raise :class:`ProtocolError` if ``value`` has more than ``max_depth`` levels of lists or maps (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= max_depth:
                raise ProtocolError(f"{what}: containers nested deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))


def unpack_msgpack(data: Any, *, max_bytes: int, what: str, max_depth: int = MAX_DEPTH,
                   max_items: int | None = None) -> Any:
    """Decode untrusted, canonical msgpack of at most ``max_bytes`` bytes; every defect raises ProtocolError.

    ``max_items`` bounds every array and map (default: the input length, msgpack's own bound); ``what`` names the
    structure in error messages.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds the limit of {max_bytes}")
    n = len(data)
    items = n if max_items is None else min(n, max_items)
    try:
        value = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
            object_pairs_hook=_unique_pairs, max_str_len=n, max_bin_len=n, max_array_len=items,
            max_map_len=items, max_ext_len=0,
        )
    except ProtocolError as exc:
        raise ProtocolError(f"{what}: {exc}") from None
    # msgpack raises a zoo of types (ExtraData, FormatError, StackError, UnicodeDecodeError, ...), all ValueError
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"{what} is not valid msgpack ({type(exc).__name__}: {str(exc)[:80]})") from None
    check_depth(value, max_depth, what)
    try:
        canonical = msgpack.packb(value, use_bin_type=True) == data
    except (ValueError, TypeError, OverflowError):
        canonical = False
    if not canonical:
        raise ProtocolError(f"{what} is not canonical msgpack (re-encoding the value gives other bytes)")
    return value
