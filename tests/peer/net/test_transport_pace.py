"""A fetched blob's body is held to a pace, not to one timeout: a state shard larger than the timeout allows at
link speed still arrives, and a sender that trickles is cut off once it falls behind the pace.

Real DHTs and p2pd daemons on 127.0.0.1. The holder's blob handler is replaced by a sender that writes the answer a
chunk at a time with pauses between: an honest peer on a slow uplink, or a hostile one holding the fetch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from control_helpers import transport_pair

from hlbp.peer.net import transport as tr
from hlbp.peer.net.pace import body_due
from hlbp.peer.net.transport import P2PBlobTransport, TransportError

BLOB = bytes(range(256)) * (12 * 1024)  # 3 MiB
MIN_RATE = 256 * 1024  # the asker's pace floor in this test, bytes a second


def test_a_body_is_due_by_the_timeout_then_at_the_pace() -> None:
    assert body_due(100.0, 30.0, 0, MIN_RATE) == 130.0
    assert body_due(100.0, 30.0, 512 * 1024, MIN_RATE) == 132.0
    # a 1B model's state shard (about 1.7 GB) over the default floor: its size's time on top of the timeout
    assert body_due(0.0, 30.0, 1_700_000_000, tr.MIN_FETCH_RATE) == pytest.approx(30.0 + 3242.5, abs=0.1)  # 54 min


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[P2PBlobTransport, P2PBlobTransport]]:
    with transport_pair() as (holder, asker):
        asker.min_rate = MIN_RATE
        yield holder, asker


def _serve_paced(holder: P2PBlobTransport, chunk: int, pause_s: float) -> None:
    """Answer every blob request with BLOB, ``chunk`` bytes at a time, ``pause_s`` apart."""

    async def paced(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await tr._read_frame(reader, 10.0)
            writer.write(tr._frame({"size": len(BLOB)}))
            for i in range(0, len(BLOB), chunk):
                writer.write(BLOB[i:i + chunk])
                await writer.drain()
                await asyncio.sleep(pause_s)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the asker hung up on us
        finally:
            writer.close()

    async def swap() -> None:
        await holder._p2p.remove_binary_stream_handler(tr.HANDLER)
        await holder._p2p.add_binary_stream_handler(tr.HANDLER, paced)

    holder._run(swap(), timeout=20)


@pytest.mark.slow
def test_a_body_longer_than_the_timeout_arrives_at_a_steady_pace(pair) -> None:
    holder, asker = pair
    _serve_paced(holder, chunk=256 * 1024, pause_s=0.25)  # 1 MiB/s: 3 MiB take 3 s against a 1 s timeout
    t0 = time.monotonic()
    assert asker.fetch(holder.peer_id, "s/1/0", 8 << 20, 1.0) == BLOB
    assert time.monotonic() - t0 > 2.0  # it did take longer than the timeout


@pytest.mark.slow
def test_a_trickling_sender_is_cut_off_once_it_falls_behind(pair) -> None:
    holder, asker = pair
    _serve_paced(holder, chunk=16 * 1024, pause_s=0.25)  # 64 KiB/s: a quarter of the floor
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="slower than"):
        asker.fetch(holder.peer_id, "s/1/0", 8 << 20, 1.0)
    # due: the first chunk (1 MiB) within 1 s + 4 s at the floor; the whole body would have taken 48 s
    assert time.monotonic() - t0 < 15.0
