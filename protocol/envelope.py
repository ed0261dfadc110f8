"""The envelope: one framed, versioned, digest-checked message on the data plane, for any body codec.

Frame layout (big-endian)::

    b"HLBP"  u8 version  u32 header_length  msgpack header  body

The header is a msgpack map. Required fields: ``run`` (str), ``round`` (int), ``shard`` (int), ``sender`` (str,
peer id), ``tokens`` (int), ``codec`` (str), ``params`` (map of codec parameters), ``digest`` (32 bytes,
blake2b-256 of the decoded body), ``enc`` (``"raw"`` or ``"zstd"``), ``len`` (body bytes on the wire) and
``raw_len`` (body bytes once decoded). Readers ignore fields they do not know, so later versions can add fields
without breaking older peers; the version byte changes only when the layout itself does.

The digest covers the decoded body, so it names the content whatever the transport encoding, and the sender's
signature over (run, round, shard, digest) binds the content to its round. zstd is used only when it saves more
than 2 % of the body: SparseLoCo bodies are already entropy-coded and are sent raw, dense bodies may gain.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field, replace

import msgpack

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.untrusted import unpack_msgpack
from hlbp.protocol.zstdframe import compress_if_smaller, decompress_bounded

MAGIC = b"HLBP"
"""First four bytes of every frame."""
ENVELOPE_VERSION = 1
"""Version of the frame layout this module writes and reads."""
PREFIX = struct.Struct(">4sBI")
PREFIX_SIZE = PREFIX.size
"""Bytes before the header: magic, version, header length."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest accepted msgpack header."""
MAX_STR_LEN = 256
"""Longest accepted run id, sender, codec name or string parameter, in characters."""
MAX_PARAMS = 64
"""Most codec parameters accepted in one header."""
DIGEST_SIZE = 32
"""Bytes of the blake2b body digest."""
_MAX_INT = 2**63 - 1
_ENCODINGS = ("raw", "zstd")

ParamValue = None | bool | int | float | str


@dataclass(frozen=True)
class EnvelopeHeader:
    """What a frame says about its body. ``digest`` is filled in by :func:`pack` and checked by :func:`unpack`."""

    run: str  # run id from the manifest; a frame of another run is not ours
    round: int  # outer round (or step, for activations) the body belongs to
    shard: int  # parameter shard / pipeline stage the body belongs to
    sender: str  # peer id of the sender
    tokens: int  # tokens the sender processed for this contribution, used for weighting
    codec: str  # body codec, e.g. "sparseloco" or "dense-fp32"
    codec_params: dict[str, ParamValue] = field(default_factory=dict)  # e.g. {"k": 64, "fmt": "entropy"}
    digest: bytes = b""  # blake2b-256 of the decoded body


def body_digest(body: bytes) -> bytes:
    """blake2b-256 of ``body``: the value carried in the header and bound into the sender's signature."""
    return hashlib.blake2b(body, digest_size=DIGEST_SIZE).digest()


def pack(header: EnvelopeHeader, body: bytes, compress: bool = True) -> bytes:
    """Frame ``body`` under ``header``; the header's ``digest`` is ignored and recomputed.

    With ``compress`` the body travels zstd-compressed when that saves more than 2 %. Raises ValueError when the
    header breaks the limits a receiver enforces, so a bad frame fails at the sender.
    """
    body = bytes(body)
    zstd, wire = compress_if_smaller(body) if compress else (False, body)
    fields = {
        "run": header.run,
        "round": header.round,
        "shard": header.shard,
        "sender": header.sender,
        "tokens": header.tokens,
        "codec": header.codec,
        "params": dict(header.codec_params),
        "digest": body_digest(body),
        "enc": "zstd" if zstd else "raw",
        "len": len(wire),
        "raw_len": len(body),
    }
    try:
        _validate(fields)
    except ProtocolError as exc:
        raise ValueError(f"cannot pack envelope: {exc}") from exc
    head = msgpack.packb(fields, use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"envelope header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, ENVELOPE_VERSION, len(head)) + head + wire


def header_length(prefix: bytes) -> int:
    """Header length announced by the first :data:`PREFIX_SIZE` bytes of a frame, after checking magic and version.

    A stream reader reads the prefix, then this many header bytes, then :func:`frame_length` tells the rest.
    """
    if len(prefix) < PREFIX_SIZE:
        raise ProtocolError(f"envelope truncated: {len(prefix)} bytes, the prefix alone is {PREFIX_SIZE}")
    magic, version, head_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not an hlbp envelope (magic {magic!r})")
    if version != ENVELOPE_VERSION:
        raise ProtocolError(
            f"envelope version {version} is not supported (this peer speaks {ENVELOPE_VERSION}); "
            "the sender and this peer need the same hlbp protocol version"
        )
    if head_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"envelope header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
    return head_len


def _parse_header(data: bytes) -> tuple[dict, int]:
    head_len = header_length(data)
    end = PREFIX_SIZE + head_len
    if len(data) < end:
        raise ProtocolError(f"envelope truncated inside the header ({len(data)} of {end} bytes)")
    fields = unpack_msgpack(data[PREFIX_SIZE:end], max_bytes=MAX_HEADER_BYTES, what="envelope header",
                            max_items=MAX_PARAMS + 16)
    if not isinstance(fields, dict):
        raise ProtocolError("envelope header must be a msgpack map")
    _validate(fields)
    return fields, end


def frame_length(head: bytes) -> int:
    """Total frame size in bytes, from a buffer holding at least the prefix and the whole header."""
    fields, end = _parse_header(head)
    return end + fields["len"]


def _require(fields: dict, key: str, kind: type) -> object:
    if key not in fields:
        raise ProtocolError(f"envelope header lacks required field {key!r}")
    value = fields[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(
            f"envelope header field {key!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    if kind is int and not 0 <= value <= _MAX_INT:
        raise ProtocolError(f"envelope header field {key!r} = {value} is out of range")
    if kind is str and len(value) > MAX_STR_LEN:
        raise ProtocolError(f"envelope header field {key!r} is longer than {MAX_STR_LEN} characters")
    return value


def _validate(fields: dict) -> None:
    for key in ("run", "sender", "codec", "enc"):
        _require(fields, key, str)
    for key in ("round", "shard", "tokens", "len", "raw_len"):
        _require(fields, key, int)
    if fields["enc"] not in _ENCODINGS:
        raise ProtocolError(
            f"envelope body encoding {fields['enc']!r} is unknown (known: {', '.join(_ENCODINGS)})"
        )
    digest = _require(fields, "digest", bytes)
    if len(digest) != DIGEST_SIZE:
        raise ProtocolError(f"envelope digest must be {DIGEST_SIZE} bytes, got {len(digest)}")
    params = _require(fields, "params", dict)
    if len(params) > MAX_PARAMS:
        raise ProtocolError(f"envelope carries {len(params)} codec parameters, at most {MAX_PARAMS} allowed")
    for key, value in params.items():
        if not isinstance(key, str) or len(key) > MAX_STR_LEN:
            raise ProtocolError("codec parameter names must be strings of at most 256 characters")
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ProtocolError(f"codec parameter {key!r} has unsupported type {type(value).__name__}")
        if isinstance(value, str) and len(value) > MAX_STR_LEN:
            raise ProtocolError(f"codec parameter {key!r} is longer than {MAX_STR_LEN} characters")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"codec parameter {key!r} is not finite")
        if isinstance(value, int) and not isinstance(value, bool) and not -_MAX_INT <= value <= _MAX_INT:
            raise ProtocolError(f"codec parameter {key!r} is out of range")


def unpack(data: bytes, max_size: int, max_body: int | None = None) -> tuple[EnvelopeHeader, bytes]:
    """Parse and verify one frame of untrusted bytes; returns the header and the decoded body.

    ``max_size`` bounds the frame; ``max_body`` (default ``max_size``) bounds the decoded body and should be what
    the receiver expects for this body (from trusted shapes), so a small zstd frame cannot make it allocate or
    hash more. The frame must end exactly where the header says, the body must decode to ``raw_len`` bytes and
    match the digest. Anything else raises :class:`ProtocolError`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"envelope must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_size:
        raise ProtocolError(f"envelope of {len(data)} bytes exceeds the limit of {max_size}")
    fields, end = _parse_header(data)
    wire = data[end:]
    if len(wire) != fields["len"]:
        raise ProtocolError(f"envelope body is {len(wire)} bytes, header says {fields['len']}")
    raw_len = fields["raw_len"]
    body_limit = max_size if max_body is None else min(max_size, max_body)
    if raw_len > body_limit:
        raise ProtocolError(f"envelope body of {raw_len} bytes exceeds the limit of {body_limit}")
    if fields["enc"] == "zstd":
        body = decompress_bounded(wire, raw_len, "envelope body")
        if len(body) != raw_len:
            raise ProtocolError(f"envelope body decodes to {len(body)} bytes, header says {raw_len}")
    else:
        if raw_len != len(wire):
            raise ProtocolError(f"raw envelope body is {len(wire)} bytes, header says {raw_len}")
        body = wire
    if body_digest(body) != fields["digest"]:
        raise ProtocolError("envelope body does not match its digest (corrupted or tampered in transit)")
    header = EnvelopeHeader(
        run=fields["run"],
        round=fields["round"],
        shard=fields["shard"],
        sender=fields["sender"],
        tokens=fields["tokens"],
        codec=fields["codec"],
        codec_params=dict(fields["params"]),
        digest=fields["digest"],
    )
    return header, body


def with_digest(header: EnvelopeHeader, body: bytes) -> EnvelopeHeader:
    """``header`` with ``digest`` set for ``body``, for a sender that signs before packing."""
    return replace(header, digest=body_digest(body))
