"""User-space WAN emulation for loopback swarms: a delaying, rate-limiting TCP proxy in front of each peer.

Why: this kernel has no ``netem``, so ``tc`` can limit rate but cannot add latency, and SparseLoCo's round makes
several sequential round trips that only a real round-trip time exposes. Each simulated peer listens on a private
port and announces a proxy port instead (``--announce-maddrs``), so every connection another peer opens to it
passes through its proxy. The proxy delivers every byte ``delay_s`` later in each direction (so each peer pair sees
a round-trip time of ``2 x delay_s``) and, when a rate is given, no faster than ``rate`` bytes/s per direction,
shared by all connections through that peer's proxy: the peer's link for the connections it accepts.

Limits, said plainly: a connection crosses only the proxy of the peer that accepted it, so a peer's traffic on the
connections it dialled is limited by the other side's link, not its own; and the proxy itself costs CPU (about
one core at a few hundred MB/s), which the rates emulated here stay far below.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PRIVATE_LOW = 20000  # free_port's lowest choice: above the well-known and most registered services' ports
CHUNK = 16 * 1024  # bytes per scheduled segment: small enough that the rate limit is smooth


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral range.

    The port is handed to a process that binds it later; one from the ephemeral range (what binding port 0 gives)
    can meanwhile become the source port of any outgoing connection on the box (p2pd dials, the proxies' own), and
    the peer then fails at start with its port in use."""
    low = _ephemeral_low()
    for port in random.sample(range(PRIVATE_LOW, low), min(64, max(low - PRIVATE_LOW, 0))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # the range below is full (or the ephemeral range starts below it)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Link:
    """One direction of a peer's link: a transmission schedule shared by every connection through its proxy."""

    rate: float | None  # bytes per second, None: unlimited
    free_at: float = 0.0  # loop time at which the link has sent everything scheduled so far

    def schedule(self, now: float, n: int) -> float:
        """Loop time at which ``n`` bytes handed over at ``now`` have left the link (serialization delay)."""
        if self.rate is None:
            return now
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate
        return self.free_at


@dataclass
class ProxyStats:
    """Bytes a proxy carried, so a test can check the swarm's traffic really went through it."""

    inbound: int = 0  # towards the peer
    outbound: int = 0  # from the peer
    connections: int = 0


@dataclass
class _Proxy:
    target_port: int
    delay_s: float
    down: Link
    up: Link
    server: asyncio.AbstractServer | None = None
    stats: ProxyStats = field(default_factory=ProxyStats)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, delay_s: float,
                on_bytes: Callable[[int], None]) -> None:
    """Copy ``reader`` to ``writer``, each segment released after the link's serialization plus ``delay_s``; the
    reader's end of stream becomes a half-close, so the other direction keeps flowing."""
    loop = asyncio.get_running_loop()
    queue: deque[tuple[float, bytes]] = deque()
    arrived = asyncio.Event()
    done = False

    async def receive() -> None:
        nonlocal done
        try:
            while data := await reader.read(CHUNK):
                queue.append((link.schedule(loop.time(), len(data)) + delay_s, data))
                arrived.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            arrived.set()

    receiver = asyncio.create_task(receive())
    try:
        while True:
            while not queue:
                if done:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                arrived.clear()
                await arrived.wait()
            due, data = queue.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            on_bytes(len(data))  # counted before delivery, so a reader that has the bytes also sees the count
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        receiver.cancel()


class WanEmulator:
    """Proxies on one background event loop; use as a context manager so every listener and task stops."""

    def __init__(self, delay_s: float, rate_mbps: float | None) -> None:
        if delay_s < 0 or rate_mbps is not None and rate_mbps <= 0:
            raise ValueError("delay must be >= 0 and the rate > 0")
        self.delay_s = delay_s
        self.rate = None if rate_mbps is None else rate_mbps * 1e6 / 8
        self.proxies: dict[int, _Proxy] = {}  # listen port -> proxy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-emulator", daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, target_port: int, listen_port: int | None = None, delay_s: float | None = None,
            rate_mbps: float | None = None) -> int:
        """Start a proxy that forwards to ``127.0.0.1:target_port``; returns the port it listens on. ``delay_s``
        and ``rate_mbps`` override the emulator's own for this link (a slower peer behind the same emulator)."""
        port = listen_port or free_port()
        rate = self.rate if rate_mbps is None else rate_mbps * 1e6 / 8
        proxy = _Proxy(target_port, self.delay_s if delay_s is None else delay_s, Link(rate), Link(rate))

        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            try:
                peer_r, peer_w = await asyncio.open_connection("127.0.0.1", proxy.target_port)
            except OSError:
                client_w.close()
                return
            proxy.stats.connections += 1

            def count_in(n: int) -> None:
                proxy.stats.inbound += n

            def count_out(n: int) -> None:
                proxy.stats.outbound += n

            try:
                await asyncio.gather(_pump(client_r, peer_w, proxy.down, proxy.delay_s, count_in),
                                     _pump(peer_r, client_w, proxy.up, proxy.delay_s, count_out))
            finally:
                for w in (peer_w, client_w):
                    with contextlib.suppress(Exception):
                        w.close()

        async def start() -> None:
            proxy.server = await asyncio.start_server(handle, "127.0.0.1", port)

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=10)
        self.proxies[port] = proxy
        return port

    def stats(self) -> dict[int, ProxyStats]:
        """Bytes carried so far, by proxy port."""
        return {port: p.stats for port, p in self.proxies.items()}

    def close(self) -> None:
        async def stop() -> None:
            for p in self.proxies.values():
                if p.server is not None:
                    p.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
