"""What a peer serves on the data plane: named blobs, and the names it is fetching itself.

The transport (``hlbp.peer.net.transport``) moves bytes; this store only says what is here. It is shared by the
threads that put blobs (the round loop, the exchange thread) and the transport's event loop that answers requests,
so every method takes its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

MAX_READERS = 1024  # readers remembered per blob

Maker = Callable[[], "bytes | None"]
"""Makes a lazy blob's bytes when it is requested; None: it has nothing to serve any more."""
Resolver = Callable[[str], "bytes | None"]
"""Makes the bytes of any name under a prefix when it is requested (the name is untrusted); None: "not here"."""


class BlobStore:
    """Named blobs served to other peers, and a count of our own fetches under way per name (a request for a name
    we are fetching waits for it instead of hearing "not here").

    A blob is held as bytes (:meth:`put`) or made on request (:meth:`put_lazy`): a shard's state is encoded from
    the parameters the peer holds anyway instead of being kept twice (docs/design.md, "Memory")."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lazy: dict[str, Maker] = {}
        self._prefixes: dict[str, Resolver] = {}
        self._sharing: dict[str, int] = {}  # name -> our fetches of it under way
        self._readers: dict[str, set[str]] = {}  # a held blob's name -> the peers it was sent to
        self._lock = threading.Lock()

    def lookup(self, name: str) -> tuple[bytes | None, bool, Maker | None]:
        """The blob ``name`` if it is here as bytes, whether a fetch of it is under way, and its maker if it is
        served lazily."""
        with self._lock:
            make = self._lazy.get(name)
            if make is None and name not in self._blobs:
                resolve = next((f for p, f in self._prefixes.items() if name.startswith(p)), None)
                if resolve is not None:
                    make = lambda: resolve(name)
            return self._blobs.get(name), name in self._sharing, make

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
            self._lazy.pop(name, None)
            self._readers.pop(name, None)
            return name in self._sharing

    def note_read(self, name: str, peer: str) -> None:
        """``name`` was sent whole to ``peer`` (kept only for blobs held as bytes, at most :data:`MAX_READERS`
        peers each: requesters are untrusted and many)."""
        with self._lock:
            if name in self._blobs:
                readers = self._readers.setdefault(name, set())
                if len(readers) < MAX_READERS:
                    readers.add(peer)

    def readers(self, name: str) -> frozenset[str]:
        """The peers the blob ``name`` (as last put) was sent to whole."""
        with self._lock:
            return frozenset(self._readers.get(name, ()))

    def put_lazy(self, name: str, make: Maker) -> None:
        """Serve ``name`` by calling ``make`` when it is requested, instead of holding its bytes."""
        with self._lock:
            self._lazy[name] = make
            self._blobs.pop(name, None)

    def put_lazy_prefix(self, prefix: str, resolve: Resolver) -> None:
        """Serve every name that starts with ``prefix`` (and is not held otherwise) by ``resolve(name)`` when it is
        requested: a store of many small items (a swarm's transcript) answers without a name per item here."""
        with self._lock:
            self._prefixes[prefix] = resolve

    def get(self, name: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(name)

    def drop(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in list(names):
                self._blobs.pop(name, None)
                self._lazy.pop(name, None)
                self._readers.pop(name, None)

    def drop_prefix(self, prefix: str) -> None:
        with self._lock:
            for name in [n for n in [*self._blobs, *self._lazy] if n.startswith(prefix)]:
                self._blobs.pop(name, None)
                self._lazy.pop(name, None)
                self._readers.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return [*self._blobs, *self._lazy]
