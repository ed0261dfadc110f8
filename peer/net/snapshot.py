"""The snapshot endpoint: every hlbp node serves the run's signed records on its data plane.

A light client (``hlbp status --light``, :mod:`hlbp.peer.light`) has no DHT: it dials one node and asks for what
that node reads from the DHT, namely the manifests, the run's announcements, every replica's latest checksums
and the newest round's accepted sets, each exactly as its author signed it (:mod:`hlbp.protocol.snapshot`). The
client verifies every record itself, so serving needs no trust and signs nothing.

Like :mod:`hlbp.peer.net.dataplane`, the handler runs inside the DHT process, on its P2P instance and DHT node, so
serving never takes the main process's time. One snapshot is built at most once a second and shared by every
request in that second, so a flood of requests costs the node's DHT no more than one reader; and each peer may ask
a few times a second at most (a light client asks once per look), so one peer cannot keep the node sending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hivemind.utils import get_dht_time

from hlbp.peer.net.dataplane import REQUEST_TIMEOUT_S
from hlbp.peer.net.pace import MIN_FETCH_RATE, SERVE_GRACE_S, write_body
from hlbp.peer.net.ratelimit import RateLimiter
from hlbp.protocol import ProtocolError
from hlbp.protocol.announcement import peers_key
from hlbp.protocol.frames import decode_header, encode_header, header_length
from hlbp.protocol.manifest import MANIFEST_KEY
from hlbp.protocol.roundwire import KIND_ACCEPTED, checks_key, parse_checks, round_key
from hlbp.protocol.snapshot import build_snapshot, encode_snapshot, parse_snapshot_request

logger = logging.getLogger(__name__)

SNAPSHOT_HANDLER = "/hlbp/snapshot/1"
CACHE_S = 1.0  # a snapshot is rebuilt at most this often
DHT_READ_TIMEOUT_S = 10.0  # reading the records from the DHT; a slower DHT answers with an error
REQUEST_RATE, REQUEST_BURST = 2.0, 10.0  # snapshot requests a second a peer may make, sustained and at once


class _State:
    """The DHT process's snapshot service: which run, which DHT node, and the last snapshot built."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.node: Any = None
        self.installed = False
        self.built_at = -1e9
        self.body = b""
        self.lock: asyncio.Lock | None = None
        self.limit = RateLimiter(rate=REQUEST_RATE, burst=REQUEST_BURST)


_STATE = _State()


async def _entries(node: Any, key: str) -> dict[Any, Any]:
    found = await node.get(key, latest=True)
    value = getattr(found, "value", None)
    return value if isinstance(value, dict) else {}


async def _build(node: Any, run_id: str) -> bytes:
    """Read the run's records from the DHT (the way ``hlbp status`` does) and encode them, unverified."""
    manifests, peers, checks = await asyncio.gather(
        _entries(node, MANIFEST_KEY), _entries(node, peers_key(run_id)), _entries(node, checks_key(run_id)))
    rounds = []
    for peer_id, item in list(checks.items())[:1024]:
        try:
            rounds.append(parse_checks(getattr(item, "value", item), str(peer_id), run_id).round)
        except ProtocolError:
            continue  # a forged checks record must not choose which round we read
    newest = max(rounds, default=None)
    accepted = {} if newest is None else await _entries(node, round_key(run_id, newest, KIND_ACCEPTED))
    snap = build_snapshot(run_id, get_dht_time(), {"manifests": manifests, "peers": peers, "checks": checks,
                                                   "accepted": accepted}, accepted_round=newest)
    return encode_snapshot(snap)


async def _snapshot_body() -> bytes:
    state = _STATE
    if state.lock is None:
        state.lock = asyncio.Lock()
    async with state.lock:
        if time.monotonic() - state.built_at >= CACHE_S:
            state.body = await asyncio.wait_for(_build(state.node, state.run_id), DHT_READ_TIMEOUT_S)
            state.built_at = time.monotonic()
        return state.body


async def _handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        if not _STATE.limit.allow(str(getattr(stream_info, "peer_id", ""))):
            writer.write(encode_header({"error": "too many snapshot requests from this peer; ask less often"}))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
            return
        length = header_length(await asyncio.wait_for(reader.readexactly(4), REQUEST_TIMEOUT_S))
        parse_snapshot_request(decode_header(await asyncio.wait_for(reader.readexactly(length), REQUEST_TIMEOUT_S)))
        try:
            body = await _snapshot_body()
        except TimeoutError:
            writer.write(encode_header({"error": "this node's DHT did not answer in time; try another peer"}))
        else:
            writer.write(encode_header({"size": len(body)}))
            await write_body(writer, body, SERVE_GRACE_S, MIN_FETCH_RATE, "a snapshot")
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
    except ProtocolError as exc:
        try:  # a client of another version learns why, instead of seeing the stream close
            writer.write(encode_header({"error": str(exc)[:200]}))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (ConnectionError, ProtocolError, TimeoutError):
            pass
        logger.debug("snapshot request from %s refused: %s", getattr(stream_info, "peer_id", "?"), exc)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
        logger.debug("snapshot request from %s failed: %s", getattr(stream_info, "peer_id", "?"), exc)
    finally:
        writer.close()


async def install_snapshot_handler(_dht: Any, node: Any, run_id: str) -> None:
    """Serve snapshots of ``run_id`` from this DHT process from now on (installed once; the run can change)."""
    _STATE.run_id, _STATE.node, _STATE.built_at = run_id, node, -1e9
    if not _STATE.installed:
        await node.p2p.add_binary_stream_handler(SNAPSHOT_HANDLER, _handle)
        _STATE.installed = True
