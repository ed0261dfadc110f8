"""What a blob request is answered with: the bytes held, a lazy blob made once for overlapping requests, or a
name this peer is fetching itself, waited for.

The transport (``hlbp.peer.net.transport``) reads a request and writes the answer; this part decides which bytes,
on the transport's event loop. A request for a name this peer is itself fetching right now waits for that fetch, up
to ``hold_s`` and with at most :data:`MAX_WAITERS` requests waiting at once, instead of hearing "not here". A lazy
blob (``BlobStore.put_lazy``) is made in a worker thread, once for all the requests that overlap.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hlbp.peer.net.blobstore import BlobStore, Maker

logger = logging.getLogger(__name__)

MAX_WAITERS = 64  # requests held open at once while our own fetch of their name finishes


class Answers:
    """The bytes to answer requests for names of ``store`` with, on ``loop``; :meth:`wake` is called from any
    thread when a name waited for is put or its fetch ends."""

    def __init__(self, store: BlobStore, loop: asyncio.AbstractEventLoop, hold_s: float) -> None:
        self.store, self.loop, self.hold_s = store, loop, hold_s
        self._wakers: dict[str, asyncio.Event] = {}  # name -> event of the requests waiting for it (loop only)
        self._waiters = 0  # requests waiting right now (loop only)
        # the bytes of a lazy blob being sent, shared by the requests that overlap (loop only):
        # name -> [future of the bytes, requests holding them]
        self._making: dict[str, list[Any]] = {}

    @property
    def waiting(self) -> int:
        """Requests waiting right now for a name this peer is fetching."""
        return self._waiters

    async def find(self, name: str) -> tuple[bytes | None, bool]:
        """The bytes to answer a request for ``name`` with (None: "not here"), and whether the request holds a share
        of a lazy blob's bytes, to give back with :meth:`release` once they are sent."""
        data, shared, make = self.store.lookup(name)
        made = data is None and make is not None
        if made:
            data = await self._made(name, make)  # type: ignore[arg-type]
        if data is None and shared and self._waiters < MAX_WAITERS:
            data = await self._await_shared(name)
        return data, made

    async def _made(self, name: str, make: Maker) -> bytes | None:
        """The bytes of the lazy blob ``name``, made in a worker thread (not on the loop: a large model's shard takes
        seconds to encode) once for all the requests that overlap; None when the maker has nothing or fails. Each
        call is paired with one :meth:`release`."""
        entry = self._making.get(name)
        if entry is None:
            entry = self._making[name] = [self.loop.run_in_executor(None, make), 0]
        entry[1] += 1
        try:
            return await asyncio.shield(entry[0])
        except Exception as exc:  # noqa: BLE001 - a maker's failure is a "not here", never the transport's end
            logger.warning("could not make %s to serve it: %s", name, exc)
            return None

    def release(self, name: str) -> None:
        """One request of the lazy blob ``name`` is done: the last one lets its bytes go."""
        entry = self._making.get(name)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._making[name]

    async def _await_shared(self, name: str) -> bytes | None:
        """The blob ``name`` once our own fetch of it is put, or None when that fetch ends without it or
        ``hold_s`` passes."""
        self._waiters += 1
        try:
            end = self.loop.time() + self.hold_s
            while True:
                data, shared, _ = self.store.lookup(name)
                left = end - self.loop.time()
                if data is not None or not shared or left <= 0:
                    return data
                try:  # no await between the check and here: a wake-up scheduled after it cannot be missed
                    await asyncio.wait_for(self._wakers.setdefault(name, asyncio.Event()).wait(), left)
                except TimeoutError:
                    pass
        finally:
            self._waiters -= 1

    def wake(self, name: str) -> None:
        """From any thread: the requests waiting for ``name`` look again."""
        def wake() -> None:
            event = self._wakers.pop(name, None)
            if event is not None:
                event.set()

        try:
            self.loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
