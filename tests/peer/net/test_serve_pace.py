"""What we serve is held to a pace too: a requester that asks for a blob and then stops reading is cut off once it
falls behind, instead of holding the serving coroutine (and the blob it shares) until it hangs up; one that reads
at a steady pace gets the whole blob, however long that takes past the grace.

Real DHTs and p2pd daemons on 127.0.0.1. The requester is a raw stream to the holder's blob handler, so the test
decides when it reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from control_helpers import transport_pair

from hlbp.peer.net import transport as tr
from hlbp.peer.net.transport import P2PBlobTransport

BLOB = bytes(range(256)) * (256 * 1024)  # 64 MiB: more than the streams between the two processes buffer
SERVE_RATE = 8 << 20  # the holder's pace floor in this test, bytes a second
GRACE_S = 1.0


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[P2PBlobTransport, P2PBlobTransport]]:
    with transport_pair() as (holder, asker):
        holder.min_rate = SERVE_RATE
        holder.put("big", BLOB)
        yield holder, asker


def _request(holder: P2PBlobTransport, asker: P2PBlobTransport, pause_s: float, chunk: int) -> tuple[int, float]:
    """Ask ``holder`` for the blob over a raw stream, read its size, then read ``chunk`` bytes ``pause_s`` apart
    (pause_s < 0: stop reading for ``-pause_s`` seconds, then read what is left); returns the body bytes read before
    the stream ended and when the last of them came (seconds from the request)."""

    async def ask() -> tuple[int, float]:
        reader, writer = await asker._open(holder.peer_id, tr.HANDLER, 10.0)
        try:
            t0 = time.monotonic()
            writer.write(tr._frame({"name": "big"}))
            await writer.drain()
            assert (await tr._read_frame(reader, 10.0))["size"] == len(BLOB)
            if pause_s < 0:
                await asyncio.sleep(-pause_s)
            got, last = 0, 0.0
            while got < len(BLOB):
                try:
                    part = await asyncio.wait_for(reader.readexactly(min(chunk, len(BLOB) - got)), 30.0)
                except asyncio.IncompleteReadError as exc:
                    return got + len(exc.partial), last
                got, last = got + len(part), time.monotonic() - t0
                if pause_s > 0:
                    await asyncio.sleep(pause_s)
            return got, last
        finally:
            writer.close()

    return asker._run(ask(), timeout=120)


@pytest.mark.slow
def test_a_requester_that_stops_reading_is_cut_off(pair, monkeypatch) -> None:
    holder, asker = pair
    monkeypatch.setattr(tr, "SERVE_GRACE_S", GRACE_S)
    served = holder.bytes_served
    got, _ = _request(holder, asker, pause_s=-12.0, chunk=1 << 20)
    # all of it would be due by 1 + 8 s; the holder stopped writing at what the streams buffered, fell behind, and
    # closed the stream: the requester finds fewer bytes than announced, and the holder counts none served
    assert got < len(BLOB)
    assert holder.bytes_served == served


@pytest.mark.slow
def test_a_requester_at_a_steady_pace_gets_the_whole_blob(pair, monkeypatch) -> None:
    holder, asker = pair
    monkeypatch.setattr(tr, "SERVE_GRACE_S", GRACE_S)
    served = holder.bytes_served
    # 1 MiB every 0.1 s: about 10 MiB/s, above the floor; the blob takes about 6 s, five times the grace
    got, last = _request(holder, asker, pause_s=0.1, chunk=1 << 20)
    assert got == len(BLOB)
    assert last > 2 * GRACE_S
    deadline = time.monotonic() + 10
    while holder.bytes_served != served + len(BLOB) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.bytes_served == served + len(BLOB)
