"""A body's pace over a stream, both ways: how long a blob may take to arrive or to be taken, and the reads and
writes that keep to it.

A body is due by a timeout for its start and then at least a floor rate (:func:`body_due`), so a large state shard
gets the time its size needs while a peer that trickles it, or stops reading it, is cut off as soon as it falls
behind, not after the whole body's allowance. The blob transport (:mod:`hlbp.peer.net.transport`), the data plane
(:mod:`hlbp.peer.net.dataplane`) and the light clients' snapshot (:mod:`hlbp.peer.net.snapshot`) read and write
their bodies through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

# the slowest a blob's body may arrive once the fetch's timeout is spent: a state shard (gigabytes on a 1B model)
# takes its size over this rate on top of the timeout, and a sender that falls behind that pace is cut off
MIN_FETCH_RATE = 512 * 1024  # bytes a second (about 4 Mbit/s)
# how long a requester may take to start reading what we serve before it must keep up with the same floor: longer
# than any fetch's own timeout (RoundConfig.fetch_timeout_s), so only a requester that stalls is cut off
SERVE_GRACE_S = 60.0
BODY_CHUNK = 1 << 20  # a body is read a chunk at a time, each due by :func:`body_due`


class TooSlow(TimeoutError):
    """A body did not move at its pace (:func:`body_due`): the peer at the other end fell behind."""


def body_due(start: float, timeout: float, received: int, min_rate: float) -> float:
    """When the first ``received`` bytes of a body whose fetch began at ``start`` must be in: ``timeout`` for
    the first byte's trip and the sender's start, then at least ``min_rate`` bytes a second. A blob that fits the
    timeout at that rate is bounded by the timeout as it always was; a larger one gets the time its size needs, and
    a sender trickling it slower is cut off as soon as it falls behind, not after the whole body's allowance."""
    return start + timeout + received / min_rate


async def write_body(writer: asyncio.StreamWriter, data: bytes, timeout: float, min_rate: float, what: str) -> None:
    """Write ``data`` a chunk at a time, each chunk's write due by :func:`body_due` from now, then drain.

    The serving side's pace: a requester that reads slower than ``min_rate`` once ``timeout`` is spent is cut off
    with :class:`TooSlow`, so it cannot hold the serving coroutine (and the blob it shares) for as long as it
    likes; an honest one on a slow link reads faster than the fetching side's own floor would let it."""
    view = memoryview(data)
    chunks = (view[sent:sent + BODY_CHUNK] for sent in range(0, len(data), BODY_CHUNK))
    await write_chunks(writer, chunks, len(data), timeout, min_rate, what)


async def write_chunks(writer: asyncio.StreamWriter, chunks: Iterable[bytes | memoryview], size: int,
                       timeout: float, min_rate: float, what: str) -> None:
    """:func:`write_body` for a body of ``size`` bytes given as ``chunks`` (one made as it is sent, as a bandwidth
    probe's zeros are)."""
    start = time.monotonic()
    sent = 0
    for chunk in chunks:
        writer.write(chunk)
        left = body_due(start, timeout, sent + len(chunk), min_rate) - time.monotonic()
        try:
            await asyncio.wait_for(writer.drain(), max(0.0, left))
        except TimeoutError:
            raise TooSlow(f"{what}: {sent:,} of {size:,} bytes taken in {time.monotonic() - start:.1f} s, slower "
                          f"than {min_rate:,.0f} B/s after {timeout:g} s") from None
        sent += len(chunk)
    await asyncio.wait_for(writer.drain(), max(0.0, body_due(start, timeout, size, min_rate) - time.monotonic()))


async def read_body(reader: asyncio.StreamReader, size: int, timeout: float, min_rate: float, what: str) -> bytes:
    """``size`` bytes from ``reader``, a chunk at a time, each chunk due by :func:`body_due` from now; a sender that
    falls behind is cut off with :class:`TooSlow`."""
    start = time.monotonic()
    chunks: list[bytes] = []
    received = 0
    while received < size:
        want = min(BODY_CHUNK, size - received)
        left = body_due(start, timeout, received + want, min_rate) - time.monotonic()
        try:
            chunks.append(await asyncio.wait_for(reader.readexactly(want), max(0.0, left)))
        except TimeoutError:
            raise TooSlow(f"{what}: {received:,} of {size:,} bytes came in {time.monotonic() - start:.1f} "
                                 f"s, slower than {min_rate:,.0f} B/s after {timeout:g} s") from None
        received += want
    return b"".join(chunks)
