"""Data-plane headers: one length-prefixed msgpack map opens every request and every response of the control
plane's data-plane handler (artifacts by hash, bandwidth probes, dial-back). Pure functions over bytes."""

from __future__ import annotations

from typing import Any

import msgpack

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.fields import _int, _str, _str_list
from hlbp.protocol.identity import _unpack
from hlbp.protocol.manifest import MAX_HEADER_BYTES, MAX_PROBE_BYTES, SHA256_RE

FRAME_PREFIX_BYTES = 4
OPS = ("artifact", "probe", "dialback")


def encode_header(header: dict[str, Any]) -> bytes:
    """A 4-byte big-endian length, then the msgpack map."""
    payload = msgpack.packb(header, use_bin_type=True)
    if len(payload) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {len(payload)} bytes exceeds the {MAX_HEADER_BYTES} limit")
    return len(payload).to_bytes(FRAME_PREFIX_BYTES, "big") + payload


def header_length(prefix: bytes) -> int:
    """Length announced by a frame prefix; refuses lengths over the header limit before anything is read."""
    if len(prefix) != FRAME_PREFIX_BYTES:
        raise ProtocolError("truncated frame prefix")
    length = int.from_bytes(prefix, "big")
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"a peer announced a {length}-byte header, over the {MAX_HEADER_BYTES} limit")
    return length


def decode_header(payload: bytes) -> dict[str, Any]:
    header = _unpack(payload, MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise ProtocolError("a frame header is a map")
    return header


def parse_request(header: dict[str, Any]) -> tuple[str, Any]:
    """(op, argument) of a request: artifact -> sha256, probe -> byte count, dialback -> multiaddrs."""
    op = _str(header, "op", 16, choices=OPS)
    if op == "artifact":
        return op, _str(header, "sha256", 64, pattern=SHA256_RE)
    if op == "probe":
        return op, _int(header, "bytes", 1, MAX_PROBE_BYTES)
    return op, _str_list(header, "maddrs", 8, 256)


def parse_body_size(header: dict[str, Any], max_size: int) -> int:
    """Body size from a response header; an ``error`` field becomes a ProtocolError carrying the peer's text."""
    if "error" in header:
        raise ProtocolError(f"peer refused: {_str(header, 'error', 256)}")
    return _int(header, "size", 0, max_size)
