"""A neighbour that stops reading a stage stream cannot make us queue for it forever: once nothing we write has
been taken for the write timeout, the stream is closed, with what was queued for it, and the owner is told.

Two real DHTs with their p2pd on 127.0.0.1; the stalling side accepts the stream and never reads from it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from stage_parts import started_dhts

from hlbp.peer.swarm import links as links_module
from hlbp.peer.swarm.links import HANDLER, StageLinks

CHUNK = bytes(1 << 20)


@pytest.mark.slow
def test_a_stream_whose_peer_takes_nothing_is_closed_after_the_write_timeout(monkeypatch) -> None:
    monkeypatch.setattr(links_module, "WRITE_TIMEOUT_S", 1.5)
    closed = threading.Event()
    held: list[asyncio.StreamWriter] = []
    with started_dhts(2) as (ours, theirs):
        sender = StageLinks(ours, lambda *a: None, lambda conn: closed.set(), lambda p, e: None, lambda p: True,
                            1 << 20)
        staller = StageLinks(theirs, lambda *a: None, lambda conn: None, lambda p, e: None, lambda p: True, 1 << 20)
        try:
            async def never_read(_info, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                held.append(writer)  # keep the stream open, read nothing
                await asyncio.sleep(3600)

            async def swap() -> None:
                await staller._p2p.remove_binary_stream_handler(HANDLER)
                await staller._p2p.add_binary_stream_handler(HANDLER, never_read)

            staller._run(swap(), 20)
            conn = sender.dial(staller.peer_id)
            for _ in range(64):  # 64 MiB: more than the streams between the processes buffer
                conn.send(CHUNK)
            deadline = time.monotonic() + 60
            while not closed.is_set() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert closed.is_set() and conn.closed
            assert conn.bytes_sent < 64 * len(CHUNK)  # it stopped writing: the rest was dropped with the stream
            assert staller.peer_id not in [c.peer for c in sender.conns.values()]
        finally:
            sender.close()
            staller.close()
