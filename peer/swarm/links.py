"""Long-lived stage streams over hivemind's P2P: one stream per neighbour, many messages each way.

:class:`StageLinks` runs its own event loop in a background thread on a replica of the DHT's P2P (as the blob
transport does), accepts streams on :data:`HANDLER` and dials them. A :class:`Conn` is one stream: ``send`` is
thread-safe and keeps order (one writer task per stream), and every message read from it goes to the
``on_message`` callback on the loop thread, which must not block (the stage server and the driver put messages on
queues for their compute threads).

Everything read is bounded before it is allocated (:mod:`hlbp.protocol.stagewire`). A peer whose message breaks
the protocol is logged once, banned with backoff through the ``on_bad`` callback, and its stream is closed; it
never reaches the compute thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from hlbp.peer.net.transport import own_p2p
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import LENGTH, StageMessage, body_length, decode_header, header_length

logger = logging.getLogger(__name__)

HANDLER = "/hlbp/stage/1"
MESSAGE_TIMEOUT_S = 120.0  # once a message has started, the rest must arrive within this
# a neighbour that takes none of what we write for this long is not reading (an honest peer reads its streams on a
# thread of their own, whatever its compute does): the stream is closed, with what was queued for it
WRITE_TIMEOUT_S = 120.0


class Conn:
    """One stage stream. ``peer`` is the remote peer id; ``dialled`` says which side opened it."""

    _ids = itertools.count()

    def __init__(self, links: StageLinks, peer: str, dialled: bool, writer: asyncio.StreamWriter) -> None:
        self.id = next(self._ids)
        self.links, self.peer, self.dialled = links, peer, dialled
        self._writer = writer
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self._task = asyncio.get_running_loop().create_task(self._write_loop())

    def send(self, data: bytes) -> None:
        """Queue ``data`` for this stream (any thread); silently dropped once the stream is closed."""
        if not self.closed:
            self.links.loop.call_soon_threadsafe(self._queue.put_nowait, data)

    async def _write_loop(self) -> None:
        try:
            while (data := await self._queue.get()) is not None:
                self._writer.write(data)
                await asyncio.wait_for(self._writer.drain(), WRITE_TIMEOUT_S)
                self.bytes_sent += len(data)
                self.links.count_sent(_op_of(data), len(data))
        except TimeoutError:
            logger.warning("stage stream to %s: it took nothing we wrote for %.0f s; closing it", self.peer[:12],
                           WRITE_TIMEOUT_S)
        except (ConnectionError, OSError, asyncio.CancelledError) as exc:
            logger.debug("stage stream to %s: write failed: %s", self.peer[:12], exc)
        finally:
            self.links.forget(self)

    def close_writer(self) -> None:
        """Close the underlying stream writer (on the loop thread, once the stream ended)."""
        self._writer.close()

    def close(self) -> None:
        if not self.closed:
            self.links.loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def __repr__(self) -> str:
        return f"Conn({self.peer[:12]}…, {'out' if self.dialled else 'in'})"


OnMessage = Callable[[Conn, StageMessage, bytes], None]


def _op_of(data: bytes) -> str:
    """The op of an encoded stage message (for the byte counters); "?" if its header does not decode."""
    try:
        return decode_header(data[LENGTH.size:LENGTH.size + header_length(data[:LENGTH.size])]).op
    except (ProtocolError, ValueError):
        return "?"


class StageLinks:
    """Stage streams of one peer; construct with a started ``hivemind.DHT``.

    ``on_message(conn, msg, body)`` and ``on_closed(conn)`` run on the loop thread. ``on_bad(peer, error)`` is
    told about a protocol violation (the stream is closed after it). ``accept(peer)`` decides whether a peer may
    open a stream to us (closed runs, swarm membership, bans). ``max_body`` bounds a frame-carrying body,
    ``max_share`` a gradient share's (0: this peer takes none).
    """

    def __init__(self, dht: Any, on_message: OnMessage, on_closed: Callable[[Conn], None],
                 on_bad: Callable[[str, str], None], accept: Callable[[str], bool], max_body: int, max_share: int = 0) -> None:
        self.on_message, self.on_closed, self.on_bad, self.accept = on_message, on_closed, on_bad, accept
        self.max_body, self.max_share = max_body, max_share
        self.conns: dict[int, Conn] = {}
        # bytes of whole messages (length prefixes, header, body) by op, over every stream this peer had, closed
        # ones included: what a benchmark divides by tokens to get bytes per token at a boundary, each way
        self.sent_by_op: dict[str, int] = {}
        self.received_by_op: dict[str, int] = {}
        self._out: dict[str, Conn] = {}  # dialled streams by peer
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hlbp-stage-links", daemon=True)
        self._thread.start()
        self._p2p = self._run(self._start(dht), 30)
        self.peer_id = str(self._p2p.peer_id)

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, dht: Any) -> Any:
        p2p = await own_p2p(dht)
        await p2p.add_binary_stream_handler(HANDLER, self._handle)
        return p2p

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(getattr(info, "peer_id", ""))
        if not self.accept(peer):
            logger.debug("refused a stage stream from %s", peer[:12])
            writer.close()
            return
        conn = Conn(self, peer, False, writer)
        self.conns[conn.id] = conn
        await self._read_loop(conn, reader)

    async def _read_loop(self, conn: Conn, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                first = await reader.readexactly(LENGTH.size)  # an idle stream may wait here forever
                n = header_length(first)
                head = await asyncio.wait_for(reader.readexactly(n), MESSAGE_TIMEOUT_S)
                msg = decode_header(head)
                size = body_length(await asyncio.wait_for(reader.readexactly(LENGTH.size), MESSAGE_TIMEOUT_S),
                                   msg, self.max_body, self.max_share)
                body = await asyncio.wait_for(reader.readexactly(size), MESSAGE_TIMEOUT_S) if size else b""
                conn.bytes_received += 8 + n + size
                self._count(self.received_by_op, msg.op, 8 + n + size)
                self.on_message(conn, msg, body)
        except ProtocolError as exc:
            self.on_bad(conn.peer, str(exc))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            logger.debug("stage stream %r ended: %s", conn, type(exc).__name__)
        except asyncio.CancelledError:
            pass
        finally:
            conn.close()
            self.forget(conn)

    @staticmethod
    def _count(totals: dict[str, int], op: str, n: int) -> None:
        totals[op] = totals.get(op, 0) + n  # only ever called on the loop thread

    def count_sent(self, op: str, n: int) -> None:
        """Count ``n`` bytes sent in a message of kind ``op`` (on the loop thread)."""
        self._count(self.sent_by_op, op, n)

    def byte_totals(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received on this peer's stage streams so far, by message op (closed streams included)."""
        return {"sent": dict(self.sent_by_op), "received": dict(self.received_by_op)}

    def forget(self, conn: Conn) -> None:
        """Drop a stream that ended (either side), close its writer and tell the owner, once."""
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.id, None)
        if self._out.get(conn.peer) is conn:
            del self._out[conn.peer]
        with contextlib.suppress(Exception):  # the transport may already be gone
            conn.close_writer()
        self.on_closed(conn)

    async def _dial(self, peer: str, timeout: float) -> Conn:
        from hivemind.p2p import PeerID

        existing = self._out.get(peer)
        if existing is not None and not existing.closed:
            return existing
        _, reader, writer = await asyncio.wait_for(
            self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), HANDLER), timeout)
        existing = self._out.get(peer)  # another caller may have dialled meanwhile
        if existing is not None and not existing.closed:
            writer.close()
            return existing
        conn = Conn(self, peer, True, writer)
        self.conns[conn.id] = conn
        self._out[peer] = conn
        self.loop.create_task(self._read_loop(conn, reader))
        return conn

    def dial(self, peer: str, timeout: float = 10.0) -> Conn:
        """The dialled stream to ``peer`` (opened once, then reused); raises ConnectionError if it can't be."""
        try:
            return self._run(self._dial(peer, timeout), timeout + 5)
        except Exception as exc:  # p2pd and asyncio fail in many types; to the caller it is one thing
            raise ConnectionError(f"cannot open a stage stream to {peer[:12]}…: {type(exc).__name__}: {exc}") from exc

    async def dial_async(self, peer: str, timeout: float = 10.0) -> Conn:
        """:meth:`dial` for callers already on the loop thread."""
        return await self._dial(peer, timeout)

    def close(self) -> None:
        """Close every stream and stop the loop; the DHT and its daemon stay up for the caller to stop."""

        async def stop() -> None:
            for conn in list(self.conns.values()):
                conn.close()
            try:
                await self._p2p.remove_binary_stream_handler(HANDLER)
                await self._p2p.shutdown()
            except Exception as exc:  # noqa: BLE001 - the daemon may already be gone
                logger.debug("closing the stage handler: %s", exc)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                self._run(stop(), 10)
            except Exception as exc:  # noqa: BLE001 - closing must not raise
                logger.debug("closing stage links: %s", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()
