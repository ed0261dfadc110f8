"""The data plane for rounds and state sync: named blobs served and fetched over libp2p streams.

One small interface, :class:`BlobTransport`: ``put`` a blob under a name, ``drop`` names, ``fetch`` a name from a
peer. :class:`P2PBlobTransport` implements it on a replica of the DHT's hivemind P2P, running its own event loop
in a background thread of this process: serving reads the in-memory blobs directly, so a donor's training thread
never waits for it, and nothing crosses the DHT process's pipe.

Frames: request = u32 length + msgpack {"name": str}; response = u32 length + msgpack {"size": int} or
{"error": str}, then ``size`` body bytes. Everything read from a stream is bounded before it is allocated.

Pushes go the other way: :meth:`P2PBlobTransport.push` sends a small record (u32 length + msgpack {"key": str,
"size": int}, then the body; answered by {"ok": true}) to peers in the background, and each receiver hands it,
with the sender's authenticated peer id, to its ``on_push`` callback. Rounds push their signed records to the
round's members this way instead of leaving them to find them by polling the DHT (:mod:`hlbp.peer.rounds.inbox`).

A request for a name this peer is itself fetching right now (inside :meth:`P2PBlobTransport.sharing`) waits for
that fetch (:mod:`hlbp.peer.net.answers` decides which bytes answer a request), up to ``hold_s`` and with at most
:data:`~hlbp.peer.net.answers.MAX_WAITERS` requests waiting at once, instead of answering "not here" and sending the
requester on to another holder. Rounds fetch a payload down a tree
(:mod:`hlbp.peer.rounds.spread`): a peer asks only its ancestors, so waits chain up the tree towards the sender,
which always holds it; two peers that count the run's peers differently can ask each other, and then each wait
ends after ``hold_s`` and both move up their chains.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from hlbp.peer.net.answers import Answers
from hlbp.peer.net.blobstore import BlobStore, Maker, Resolver
from hlbp.peer.net.pace import MIN_FETCH_RATE, SERVE_GRACE_S, TooSlow, body_due, read_body, write_body
from hlbp.peer.net.ratelimit import RateLimiter
from hlbp.protocol import ProtocolError

if TYPE_CHECKING:
    from hlbp.peer.net.reach import Dialer

logger = logging.getLogger(__name__)

HANDLER = "/hlbp/blob/1"
PUSH_HANDLER = "/hlbp/push/1"
MAX_PUSH = 64 * 1024  # a pushed record's body: round records stay under 48 KiB
PUSH_RATE = 20.0  # pushes a second a peer may send us, sustained (an honest one sends a few a round)
PUSH_BURST = 100.0  # pushes a peer may send us at once
# blob requests a second a peer may make of us: a round's payloads, a few per shard, for a peer that fetches from us
FETCH_RATE, FETCH_BURST = 20.0, 200.0
# requests for our state's shards (names under STATE_PREFIX): a resyncing peer takes each shard once, then retries now and then
# (each answer can be many megabytes: a flood of these would keep our uplink full)
STATE_RATE, STATE_BURST = 0.5, 32.0
STATE_PREFIX = "s/"  # the names of state shards (hlbp.peer.rounds.statesync.state_name)
MAX_HEADER = 4096
MAX_NAME = 256
_LEN = struct.Struct(">I")


async def own_p2p(dht: Any) -> Any:
    """A client of the DHT's p2pd for the calling event loop alone.

    hivemind's ``DHT.replicate_p2p`` caches one replica per process, bound to the event loop of its first caller.
    The blob transport and the stage links each run their own loop thread: sharing that replica put one
    component's stream handlers and write tasks on the other's loop, where wake-ups from its own thread were lost
    (a stage server's answers sat unsent), and closing one shut the other's client down.
    """
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
    return await P2P.replicate(maddr)

class TransportError(ConnectionError):
    """A fetch failed: the peer is unreachable, timed out, does not have the blob, or sent something malformed."""


class BlobTransport(Protocol):
    """What rounds and state sync need of the network's data plane."""

    peer_id: str
    bytes_served: int  # body bytes this peer has uploaded to others

    def put(self, name: str, data: bytes) -> None: ...

    def put_lazy(self, name: str, make: Maker) -> None: ...

    def put_lazy_prefix(self, prefix: str, resolve: Resolver) -> None: ...

    def get(self, name: str) -> bytes | None: ...

    def drop(self, names: Iterable[str]) -> None: ...

    def readers(self, name: str) -> frozenset[str]: ...

    def drop_prefix(self, prefix: str) -> None: ...

    def sharing(self, name: str) -> AbstractContextManager[None]: ...

    def push(self, peer_ids: Iterable[str], key: str, body: bytes) -> None: ...

    def set_push_handler(self, handler: Callable[[str, str, bytes], None] | None) -> None: ...

    def fetch(self, peer_id: str, name: str, max_size: int, timeout: float) -> bytes: ...

    def reach_out(self, timeout: float) -> int: ...

    def close(self) -> None: ...


def _frame(obj: dict[str, Any]) -> bytes:
    head = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(head)) + head


async def _read_frame(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    (n,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(_LEN.size), timeout))
    if n > MAX_HEADER:
        raise ProtocolError(f"frame header of {n} bytes exceeds {MAX_HEADER}")
    try:
        obj = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(n), timeout), raw=False)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"frame header is not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame header must be a map")
    return obj


class P2PBlobTransport:
    """:class:`BlobTransport` on hivemind's P2P (p2pd); construct with a started ``hivemind.DHT``."""

    def __init__(self, dht: Any, request_timeout: float = 10.0, cancel: threading.Event | None = None,
                 allowed: Callable[[str], bool] | None = None, hold_s: float = 5.0,
                 addresses: Callable[[str], Sequence[str]] | None = None,
                 dialable_peers: Callable[[], Sequence[str]] | None = None,
                 min_rate: float = MIN_FETCH_RATE) -> None:
        self.request_timeout = request_timeout
        # the slowest pace a body may move at past the timeout (body_due), fetched or served: a fetch from a peer
        # that sends slower is cut off, and so is a requester that reads slower
        self.min_rate = min_rate
        # peer id -> its announced multiaddrs: a stream our p2pd cannot route is retried after connecting there
        # (hlbp.peer.net.reach); None: only the addresses p2pd learnt by itself
        self.addresses = addresses
        self.dialable_peers = dialable_peers  # the peers :meth:`reach_out` connects to (blocking: run off the loop)
        self.dialer: Dialer | None = None
        # how long a request for a name we are fetching waits for it: under the 6 s a round gives a holder
        # (RoundConfig.fetch_timeout_s / 5), so the requester still hears "not here" and moves on in time
        self.hold_s = hold_s
        self.cancel = cancel  # once set (the peer is leaving), every fetch under way or to come fails at once
        self.allowed = allowed  # closed runs: which peer ids may fetch from us (None: anyone)
        self.bytes_served = 0
        self.bytes_fetched = 0
        self.on_push: Callable[[str, str, bytes], None] | None = None  # (sender, key, body) of each push received
        # a peer pushes a few records a round (its notice, an accepted set, its checksums): far more is a flood,
        # refused before its frame is read
        self.push_limit = RateLimiter(rate=PUSH_RATE, burst=PUSH_BURST)
        # and so are blob requests, each before its name is read; state shards have a tighter bucket of their own
        self.fetch_limit = RateLimiter(rate=FETCH_RATE, burst=FETCH_BURST)
        self.state_limit = RateLimiter(rate=STATE_RATE, burst=STATE_BURST)
        self.pushes_sent = 0
        self.push_failures = 0
        self.store = BlobStore()  # what we serve, and the names we are fetching ourselves
        self._loop = asyncio.new_event_loop()
        self.answers = Answers(self.store, self._loop, hold_s)  # which bytes a request is answered with
        self._thread = threading.Thread(target=self._loop.run_forever, name="hlbp-transport", daemon=True)
        self._thread.start()
        self._p2p = self._run(self._start(dht), timeout=30)
        self.peer_id = str(self._p2p.peer_id)

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, dht: Any) -> Any:
        p2p = await own_p2p(dht)
        if self.addresses is not None:
            # reach imports hivemind's daemon bindings: not at module load, which the light client's status report
            # reaches through the round rules, and which must not load hivemind
            from hlbp.peer.net.reach import Dialer

            self.dialer = Dialer(p2p.daemon_listen_maddr, self.addresses)
        await p2p.add_binary_stream_handler(HANDLER, self._handle)
        await p2p.add_binary_stream_handler(PUSH_HANDLER, self._handle_push)
        return p2p

    def set_push_handler(self, handler: Callable[[str, str, bytes], None] | None) -> None:
        """Call ``handler(sender, key, body)`` for every push received (on the transport's thread: keep it short)."""
        self.on_push = handler

    async def _handle_push(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(getattr(info, "peer_id", ""))
        try:
            if self.allowed is not None and not self.allowed(sender):
                logger.debug("refused a push from %s: not in the run's allow-list", sender)
                return
            if not self.push_limit.allow(sender):
                if self.push_limit.banned(sender):
                    logger.debug("refused a push from %s: banned for flooding", sender)
                return
            head = await _read_frame(reader, self.request_timeout)
            key, size = head.get("key"), head.get("size")
            if not isinstance(key, str) or len(key) > MAX_NAME:
                raise ProtocolError("push key must be a short string")
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PUSH:
                raise ProtocolError(f"push of {size!r} bytes; the limit is {MAX_PUSH}")
            body = await asyncio.wait_for(reader.readexactly(size), self.request_timeout)
            handler = self.on_push
            if handler is not None:
                handler(sender, key, body)
            writer.write(_frame({"ok": True}))
            await asyncio.wait_for(writer.drain(), self.request_timeout)
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError, struct.error) as e:
            logger.debug("push from %s failed: %s", sender, e)
        except Exception as e:  # noqa: BLE001 - a handler's bug must not end the transport's loop
            logger.warning("handling a push from %s failed: %s: %s", sender[:16], type(e).__name__, e)
        finally:
            writer.close()

    def push(self, peer_ids: Iterable[str], key: str, body: bytes, timeout: float = 5.0) -> None:
        """Send ``body`` under ``key`` to each of ``peer_ids``, in the background: never blocks the caller. A
        failure is only counted (``push_failures``): whoever relies on a push has the DHT as its fallback."""
        if len(body) > MAX_PUSH or len(key) > MAX_NAME:
            raise ValueError(f"a push is at most {MAX_PUSH} bytes under a key of at most {MAX_NAME} characters")
        for peer in set(peer_ids) - {self.peer_id}:
            try:
                asyncio.run_coroutine_threadsafe(self._push(peer, key, bytes(body), timeout), self._loop)
            except RuntimeError:  # the loop is closed: we are leaving
                return

    async def _open(self, peer_id: str, handler: str, timeout: float) -> tuple[asyncio.StreamReader,
                                                                                 asyncio.StreamWriter]:
        """A stream to ``handler`` of ``peer_id``: over a connection p2pd has or can route, else after connecting
        at the peer's announced addresses (a peer behind NAT dials out this way, to a public peer)."""
        from hivemind.p2p import PeerID

        peer = PeerID.from_base58(peer_id)
        deadline = self._loop.time() + timeout  # the connect and the retry share the one timeout
        try:
            _, reader, writer = await asyncio.wait_for(self._p2p.call_binary_stream_handler(peer, handler), timeout)
            return reader, writer
        except asyncio.CancelledError:
            raise
        except Exception:
            if (self.dialer is None or deadline - self._loop.time() <= 0
                    or not await self.dialer.connect(peer_id, deadline - self._loop.time())):
                raise
        left = deadline - self._loop.time()
        if left <= 0:
            raise TimeoutError(f"opening a stream to {peer_id[:12]}… took longer than {timeout:.1f} s")
        _, reader, writer = await asyncio.wait_for(self._p2p.call_binary_stream_handler(peer, handler), left)
        return reader, writer

    async def _push(self, peer_id: str, key: str, body: bytes, timeout: float) -> None:
        try:
            reader, writer = await self._open(peer_id, PUSH_HANDLER, timeout)
            try:
                writer.write(_frame({"key": key, "size": len(body)}) + body)
                await writer.drain()
                await _read_frame(reader, timeout)  # the receiver has it
                self.pushes_sent += 1
            finally:
                writer.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - p2pd, asyncio and the peer all fail in their own types
            self.push_failures += 1
            logger.debug("push of %s to %s failed: %s: %s", key, peer_id[:16], type(exc).__name__, exc)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        made: str | None = None  # the lazy blob this request holds a share of (released at the end)
        try:
            requester = str(getattr(info, "peer_id", ""))
            if self.allowed is not None and not self.allowed(requester):
                logger.debug("refused a blob request from %s: not in the run's allow-list", requester)
                return
            if not self.fetch_limit.allow(requester):
                return  # closed unanswered: a flood costs us no read
            request = await _read_frame(reader, self.request_timeout)
            name = request.get("name")
            if not isinstance(name, str) or len(name) > MAX_NAME:
                raise ProtocolError("request name must be a short string")
            if name.startswith(STATE_PREFIX) and not self.state_limit.allow(requester):
                writer.write(_frame({"error": "too many state requests"}))
                await asyncio.wait_for(writer.drain(), self.request_timeout)
                return
            data, holds = await self.answers.find(name)
            made = name if holds else None
            if data is None:
                writer.write(_frame({"error": "not here"}))
                await asyncio.wait_for(writer.drain(), self.request_timeout)
            else:
                writer.write(_frame({"size": len(data)}))
                await write_body(writer, data, SERVE_GRACE_S, self.min_rate, f"{name} to {requester[:12]}…")
            if data is not None:
                self.bytes_served += len(data)
                self.store.note_read(name, requester)
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError, struct.error) as e:
            logger.debug("blob request from %s failed: %s", getattr(info, "peer_id", "?"), e)
        finally:
            if made is not None:
                self.answers.release(made)
            writer.close()

    @contextmanager
    def sharing(self, name: str) -> Iterator[None]:
        """Mark a fetch of ``name`` as under way: requests for it wait (bounded) until it is :meth:`put` or the
        block ends, instead of hearing "not here"."""
        self.store.begin_sharing(name)
        try:
            yield
        finally:
            self.store.end_sharing(name)
            self.answers.wake(name)

    def put(self, name: str, data: bytes) -> None:
        if len(name) > MAX_NAME:
            raise ValueError(f"blob name longer than {MAX_NAME}")
        if self.store.put(name, data):
            self.answers.wake(name)

    def put_lazy(self, name: str, make: Maker) -> None:
        """Serve ``name`` by calling ``make`` in a worker thread when it is requested (None from it: "not here")."""
        if len(name) > MAX_NAME:
            raise ValueError(f"blob name longer than {MAX_NAME}")
        self.store.put_lazy(name, make)

    def put_lazy_prefix(self, prefix: str, resolve: Resolver) -> None:
        """Serve every name under ``prefix`` by ``resolve(name)`` in a worker thread when it is requested."""
        self.store.put_lazy_prefix(prefix, resolve)

    def get(self, name: str) -> bytes | None:
        return self.store.get(name)

    def drop(self, names: Iterable[str]) -> None:
        self.store.drop(names)

    def drop_prefix(self, prefix: str) -> None:
        self.store.drop_prefix(prefix)

    def readers(self, name: str) -> frozenset[str]:
        """The peers our blob ``name`` was sent to whole (as far as our writes went: not proof it arrived)."""
        return self.store.readers(name)

    def names(self) -> list[str]:
        return self.store.names()

    async def _fetch(self, peer_id: str, name: str, max_size: int, timeout: float) -> bytes:
        reader, writer = await self._open(peer_id, HANDLER, timeout)
        try:
            writer.write(_frame({"name": name}))
            await writer.drain()
            response = await _read_frame(reader, timeout)
            if "error" in response:
                raise TransportError(f"{peer_id[:12]}… has no {name}: {str(response['error'])[:80]}")
            size = response.get("size")
            if not isinstance(size, int) or not 0 <= size <= max_size:
                raise ProtocolError(f"peer announced a body of {size!r} bytes; the limit is {max_size}")
            try:
                body = await read_body(reader, size, timeout, self.min_rate, f"{name} from {peer_id[:12]}…")
            except TooSlow as exc:
                raise TransportError(str(exc)) from None
            self.bytes_fetched += size
            return body
        finally:
            writer.close()

    def fetch(self, peer_id: str, name: str, max_size: int, timeout: float) -> bytes:
        """The blob ``name`` from ``peer_id``.

        Raises :class:`ProtocolError` when the peer's response breaks the protocol (a malformed frame, or a body
        above ``max_size``: provably the peer's fault), and :class:`TransportError` for any other failure.
        """
        if self.cancel is not None and self.cancel.is_set():
            raise TransportError(f"not fetching {name}: this peer is stopping")
        future = asyncio.run_coroutine_threadsafe(self._fetch(peer_id, name, max_size, timeout), self._loop)
        # a backstop only: the fetch keeps its own time (the timeout, and a body's pace, body_due)
        deadline = body_due(time.monotonic(), timeout + 5, max_size, self.min_rate)
        try:
            while True:
                try:
                    return future.result(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
                except concurrent.futures.TimeoutError:
                    if self.cancel is not None and self.cancel.is_set():
                        future.cancel()
                        raise TransportError(f"fetching {name} from {peer_id[:12]}… was cancelled: this peer is "
                                             "stopping") from None
                    if time.monotonic() >= deadline:
                        future.cancel()
                        raise
        except (TransportError, ProtocolError):
            raise
        except Exception as exc:  # p2pd, asyncio and the peer's bytes all fail in their own types
            raise TransportError(f"fetching {name} from {peer_id[:12]}… failed: {type(exc).__name__}: {exc}") from exc

    def reach_out(self, timeout: float = 5.0) -> int:
        """Connect to every dialable peer of the run (a peer behind NAT, before it publishes its notice), so that
        they can open streams to us over those connections; returns how many are connected. Blocks at most about
        ``timeout``; a peer that does not answer is only left out (it then fetches our payload from a holder)."""
        if self.dialer is None or self.dialable_peers is None:
            return 0
        dialer, peers_of = self.dialer, self.dialable_peers

        async def connect_all() -> int:
            peers = [p for p in await asyncio.to_thread(peers_of) if p != self.peer_id]
            done = await asyncio.gather(*(dialer.connect(p, timeout) for p in peers), return_exceptions=True)
            return sum(1 for ok in done if ok is True)

        try:
            return self._run(connect_all(), timeout=timeout + 5)
        except Exception as exc:  # noqa: BLE001 - reaching out is best effort: a fetch still tries the holders
            logger.debug("reaching out to the run's dialable peers failed: %s", exc)
            return 0

    def close(self) -> None:
        """Stop serving and end the transport's loop; the DHT and its daemon stay up for the caller to stop."""

        async def stop() -> None:
            try:
                await self._p2p.remove_binary_stream_handler(HANDLER)
                await self._p2p.remove_binary_stream_handler(PUSH_HANDLER)
                await self._p2p.shutdown()  # a replica owns no daemon: this closes only our client connections
            except Exception as exc:  # noqa: BLE001 - the daemon may already be gone when a peer shuts down
                logger.debug("closing the blob handler failed: %s", exc)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            try:
                self._run(stop(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - closing must not raise: the peer is leaving anyway
                logger.debug("closing the transport: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
