"""A peer that asks for snapshots too often is told to slow down instead of being sent the run's records again.

The snapshot handler itself on a real local stream (asyncio over 127.0.0.1); the requester's peer id is what
libp2p would authenticate. The snapshot it serves comes from a stand-in body: reading a DHT is not what is tested.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hlbp.peer.net import snapshot as sn
from hlbp.peer.net.ratelimit import RateLimiter
from hlbp.protocol.frames import decode_header, encode_header, header_length
from hlbp.protocol.snapshot import snapshot_request


async def _ask(port: int) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_header(snapshot_request()))
    await writer.drain()
    head = decode_header(await reader.readexactly(header_length(await reader.readexactly(4))))
    writer.close()
    return head


def test_past_its_rate_a_peer_is_refused_without_a_snapshot() -> None:
    async def scenario() -> list[dict]:
        sn._STATE.limit = RateLimiter(rate=0.001, burst=2)
        sn._STATE.body, sn._STATE.built_at = b"records", float("inf")
        info = SimpleNamespace(peer_id="12D3KooWsamepeer")
        server = await asyncio.start_server(lambda r, w: sn._handle(info, r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return [await _ask(port) for _ in range(4)]
        finally:
            server.close()
            await server.wait_closed()

    saved = (sn._STATE.limit, sn._STATE.body, sn._STATE.built_at)
    try:
        answers = asyncio.run(scenario())
    finally:
        sn._STATE.limit, sn._STATE.body, sn._STATE.built_at = saved
    assert [a.get("size") for a in answers[:2]] == [len(b"records")] * 2
    assert all("too many snapshot requests" in a.get("error", "") for a in answers[2:])
