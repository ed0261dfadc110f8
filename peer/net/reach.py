"""Reaching peers at the addresses they announced, and what a peer behind NAT can and cannot do.

A p2pd only dials a peer whose addresses it has learnt: from a connection, or from the libp2p DHT, which hlbp's
peers do not run as servers when they are DHT clients. A replica behind NAT (DHT client mode) therefore could not
open a stream even to a public peer ("routing: not found"), and a public peer could not reach one whose addresses it
never saw. :class:`Dialer` connects to a peer at the addresses of its signed announcement (read through an
:class:`AddressBook`) when a stream cannot be opened otherwise.

A peer behind NAT cannot be dialled at all, but a libp2p connection carries streams both ways: once it has dialled
a public peer, that peer opens its fetches over the same connection. That is how a NATed replica's payload
reaches the others: before it publishes a round's notice it connects to every dialable peer of the run
(``P2PBlobTransport.reach_out``), so whoever fetches the payload after seeing the notice finds a connection.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

logger = logging.getLogger(__name__)


class Reachability(enum.Enum):
    """Whether other peers can open a connection to a peer; the value is what its announcement carries."""

    PUBLIC = "public"  # a peer of the run dialled it back at join: anyone can connect to it
    CLIENT = "client"  # nobody could dial it (NAT, firewall): it only dials out, as a DHT client
    UNKNOWN = "unknown"  # nobody answered the dial-back request

    @classmethod
    def of(cls, text: str) -> Reachability:
        """The reachability an announcement names (its decoder already refused any other value)."""
        return cls(text)


class AddressBook:
    """Peer id -> the multiaddrs and reachability its announcement names, re-read at most every ``refresh_s``.

    ``read`` returns the run's verified announcements (peer id -> :class:`SignedAnnouncement`); it blocks on the
    DHT, so call :meth:`lookup` from a worker thread, never from an event loop.
    """

    def __init__(self, read: Callable[[], Mapping[str, Any]], refresh_s: float = 5.0, min_reread_s: float = 1.0) -> None:
        self.read, self.refresh_s = read, refresh_s
        # a peer we do not know forces a re-read, but at most this often: fetches named by strangers cost one read
        self.min_reread_s = min(min_reread_s, refresh_s)
        self._entries: dict[str, tuple[tuple[str, ...], Reachability]] = {}
        self._stages: dict[str, int] = {}  # online stage peers -> the stage their announcement names
        self._read_at = -float("inf")
        self._lock = threading.Lock()

    def _refresh(self, force: bool) -> None:
        with self._lock:
            if time.monotonic() - self._read_at < (self.min_reread_s if force else self.refresh_s):
                return
            self._read_at = time.monotonic()
        try:
            records = self.read()
        except Exception as exc:  # noqa: BLE001 - a failed read leaves the old entries: the next one may succeed
            logger.debug("reading the run's announcements failed: %s", exc)
            return
        entries = {p: (tuple(r.announcement.maddrs), Reachability.of(r.announcement.reachability))
                   for p, r in records.items() if r.announcement.online}
        stages = {p: r.announcement.stage for p, r in records.items()
                  if r.announcement.online and r.announcement.role == "stage" and r.announcement.stage is not None}
        with self._lock:
            self._entries, self._stages = entries, stages

    def lookup(self, peer_id: str) -> tuple[tuple[str, ...], Reachability]:
        """(announced multiaddrs, reachability) of ``peer_id``; an unknown peer re-reads the records once."""
        self._refresh(force=False)
        with self._lock:
            found = self._entries.get(peer_id)
        if found is None:
            self._refresh(force=True)
            with self._lock:
                found = self._entries.get(peer_id)
        return found if found is not None else ((), Reachability.UNKNOWN)

    def stage(self, peer_id: str) -> int | None:
        """The stage ``peer_id``'s own signed announcement says it serves (None: not an online stage peer)."""
        self.lookup(peer_id)  # refreshed as lookup does: an unknown peer re-reads the records once
        with self._lock:
            return self._stages.get(peer_id)

    def maddrs(self, peer_id: str) -> tuple[str, ...]:
        return self.lookup(peer_id)[0]

    def dialable(self) -> list[str]:
        """The online peers others can dial (public or unknown), as last read: those a NATed peer reaches out to."""
        self._refresh(force=False)
        with self._lock:
            return sorted(p for p, (maddrs, reach) in self._entries.items() if maddrs and reach is not Reachability.CLIENT)


def _parse(maddrs: Sequence[str]) -> list[Multiaddr]:
    """The announced addresses as the daemon wants them: without the /p2p/ part, malformed ones left out."""
    out = []
    for text in maddrs:
        try:
            addr = Multiaddr(text.split("/p2p/")[0])
        except (MultiaddrError, ValueError, KeyError, TypeError):
            continue
        out.append(addr)
    return out


class Dialer:
    """Connects our p2pd to a peer at its announced addresses (see the module docstring).

    ``daemon_maddr``: our p2pd's control address; ``addresses``: peer id -> announced multiaddrs (blocking: it is
    run in a worker thread).
    """

    def __init__(self, daemon_maddr: Multiaddr, addresses: Callable[[str], Sequence[str]]) -> None:
        self.daemon = DaemonConnector(daemon_maddr)
        self.addresses = addresses
        self.connects = 0  # connections opened through announced addresses
        self.failures = 0

    async def _connect(self, peer: PeerID, maddrs: list[Multiaddr]) -> None:
        """p2pd's CONNECT request (hivemind's ControlClient sends the same, but only a full client can be built)."""
        reader, writer = await self.daemon.open_connection()
        try:
            request = p2pd_pb2.Request(type=p2pd_pb2.Request.CONNECT, connect=p2pd_pb2.ConnectRequest(
                peer=peer.to_bytes(), addrs=[a.to_bytes() for a in maddrs]))
            await write_pbmsg(writer, request)
            response = p2pd_pb2.Response()
            await read_pbmsg_safe(reader, response)
            raise_if_failed(response)
        finally:
            writer.close()

    async def connect(self, peer_id: str, timeout: float) -> bool:
        """Open a connection to ``peer_id`` at its announced addresses; False when it has none or none answers."""
        maddrs = _parse(await asyncio.to_thread(self.addresses, peer_id))
        if not maddrs:
            return False
        try:
            await asyncio.wait_for(self._connect(PeerID.from_base58(peer_id), maddrs), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the daemon reports a failed dial in its own error type
            self.failures += 1
            logger.debug("could not connect to %s at %s: %s", peer_id[:16], maddrs, exc)
            return False
        self.connects += 1
        return True
