"""What a peer serves on the data plane: named blobs, and the names it is fetching itself.

The transport (``hlbp.peer.net.transport``) moves bytes; this store only says what is here. It is shared by the
threads that put blobs (the round loop, the exchange thread) and the transport's event loop that answers requests,
so every method takes its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class BlobStore:
    """Named blobs served to other peers, and a count of our own fetches under way per name (a request for a name
    we are fetching waits for it instead of hearing "not here")."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._sharing: dict[str, int] = {}  # name -> our fetches of it under way
        self._lock = threading.Lock()

    def lookup(self, name: str) -> tuple[bytes | None, bool]:
        """The blob ``name`` if it is here, and whether a fetch of it is under way."""
        with self._lock:
            return self._blobs.get(name), name in self._sharing

    def begin_sharing(self, name: str) -> None:
        """A fetch of ``name`` started."""
        with self._lock:
            self._sharing[name] = self._sharing.get(name, 0) + 1

    def end_sharing(self, name: str) -> None:
        """A fetch of ``name`` ended (with or without it)."""
        with self._lock:
            left = self._sharing.pop(name) - 1
            if left:
                self._sharing[name] = left

    def put(self, name: str, data: bytes) -> bool:
        """Serve ``data`` as ``name``; returns whether a fetch of it is under way (its waiters are to be woken)."""
        with self._lock:
            self._blobs[name] = bytes(data)
            return name in self._sharing

    def get(self, name: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(name)

    def drop(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in list(names):
                self._blobs.pop(name, None)

    def drop_prefix(self, prefix: str) -> None:
        with self._lock:
            for name in [n for n in self._blobs if n.startswith(prefix)]:
                del self._blobs[name]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._blobs)
