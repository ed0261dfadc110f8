"""zstd for untrusted payloads: compress only where it pays, decompress only to a size known in advance.

python-zstandard allocates whatever a frame header claims as its content size, whatever ``max_output_size`` says.
A forged header could therefore ask for terabytes. :func:`decompress_bounded` reads the declared size first and
refuses anything above the caller's limit, then refuses frames without a declared size, extra frames and trailing
bytes, so one payload has exactly one valid encoding per compressed stream.
"""

from __future__ import annotations

import zstandard

from hlbp.protocol.errors import ProtocolError

ZSTD_LEVEL = 3
"""Fast level: the streams it sees are small or already dense, and higher levels gained < 0.5 % in our tests."""
MIN_SAVING = 0.02
"""zstd is kept only when it saves more than this fraction, so receivers skip pointless decompression."""
MIN_INPUT = 64
"""Inputs shorter than this are sent raw: the frame header alone would eat the saving."""


def compress_if_smaller(raw: bytes) -> tuple[bool, bytes]:
    """``(True, frame)`` when zstd saves more than 2 % of ``raw``, else ``(False, raw)``."""
    if len(raw) < MIN_INPUT:
        return False, raw
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)
    if len(frame) < (1.0 - MIN_SAVING) * len(raw):
        return True, frame
    return False, raw


def decompress_bounded(frame: bytes, max_size: int, what: str) -> bytes:
    """Decompress a single zstd frame whose declared content size is at most ``max_size``.

    ``max_size`` should be what the receiver expects (derived from trusted shapes), not a global cap: the output is
    allocated at the declared size, which is checked first. Only frames :func:`compress_if_smaller` could have
    written are accepted: a declared size of at least :data:`MIN_INPUT` bytes, and a frame that saves more than
    :data:`MIN_SAVING` of it. Smaller bodies travel raw, so a frame declaring 0 bytes (which python-zstandard
    would "decompress" to ``b""`` without reading what follows) is refused. ``what`` names the stream in error
    messages. Any defect raises :class:`ProtocolError`.
    """
    frame = bytes(frame)
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: not a zstd frame ({exc})") from exc
    if size < 0:
        raise ProtocolError(f"{what}: zstd frame does not declare its content size")
    if size > max_size:
        raise ProtocolError(f"{what}: zstd frame declares {size} bytes, more than the {max_size} allowed")
    if size < MIN_INPUT or len(frame) >= (1.0 - MIN_SAVING) * size:
        raise ProtocolError(
            f"{what}: a zstd frame of {len(frame)} bytes declaring {size} is not canonical "
            f"(bodies under {MIN_INPUT} bytes, or that zstd shrinks by less than {MIN_SAVING:.0%}, travel raw)"
        )
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: corrupt zstd frame ({exc})") from exc
    if len(out) != size:
        raise ProtocolError(f"{what}: zstd frame declared {size} bytes but produced {len(out)}")
    return out
