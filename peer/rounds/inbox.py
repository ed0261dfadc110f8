"""Round records pushed to us by their signers, beside the DHT (issue: fewer sequential round trips per round).

A round's critical path was a chain of DHT records, each a store (one or two round trips), then a poll interval
and a read (one or two more) before the next peer could act: the contribution notices, the accepted set, the
checksums. Each signer now also pushes the same signed bytes straight to the round's live members over the data
plane (:meth:`hlbp.peer.net.transport.P2PBlobTransport.push`), one one-way trip, and the receiver's wait wakes as
soon as they land. The DHT stays the record of truth and the fallback: a record that was not pushed to us (we
were not known yet, the push was lost) still arrives by the poll.

The inbox only holds bytes. Every record in it is parsed, signature included, by the same code as a DHT record,
under the subkey of the peer that pushed it, which the libp2p connection authenticated. It is bounded: only keys
the runner wants right now, one record per sender and key, at most ``max_senders`` senders and
``max_bytes_per_key`` bytes per key. A flood of pushes can fill a key; the DHT poll still delivers it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hlbp.peer.net.dht import DHT_DIED


@dataclass(frozen=True)
class Both:
    """A sender's record as the DHT returned it and as the sender pushed it, when the two differ: the reader parses
    both and keeps the later round (a push is usually the newer, but a sender that stopped pushing to us, because it
    no longer sees us live, leaves an old one in our inbox while the DHT moves on)."""

    stored: Any
    pushed: bytes


def merge(stored: Mapping[str, Any], pushed: Mapping[str, bytes]) -> dict[str, Any]:
    """DHT entries (subkey -> value) with the pushed records added; a sender whose two differ maps to :class:`Both`."""
    out = dict(stored)
    for sender, body in pushed.items():
        old = out.get(sender)
        out[sender] = body if old is None or old == body else Both(old, body)
    return out


class Inbox:
    """Pushed records by DHT key and sender (thread-safe); :meth:`wait` wakes on each new one."""

    def __init__(self, max_record_bytes: int, max_senders: int = 256, max_bytes_per_key: int = 1 << 20) -> None:
        self.max_record_bytes = max_record_bytes
        self.max_senders = max_senders
        self.max_bytes_per_key = max_bytes_per_key
        self.wanted: Callable[[str], bool] = lambda _key: False  # which keys are taken now (set by the runner)
        self._records: dict[str, dict[str, bytes]] = {}
        self._arrived: dict[str, dict[str, float]] = {}  # key -> sender -> when its record landed (monotonic)
        self._cond = threading.Condition()
        self._version = 0
        self._seen = 0
        self.refused = 0  # pushes dropped: unwanted key, too big, or the key full
        self._full: set[str] = set()  # keys that refused a sender for want of room

    def offer(self, sender: str, key: str, body: bytes) -> bool:
        """Keep ``body`` as ``sender``'s record under ``key`` if the key is wanted and within bounds."""
        if not self.wanted(key) or len(body) > self.max_record_bytes:
            self.refused += 1
            return False
        with self._cond:
            held = self._records.setdefault(key, {})
            old = held.get(sender)
            if old == body:
                return True
            size = sum(len(b) for b in held.values()) - len(old or b"") + len(body)
            if (old is None and len(held) >= self.max_senders) or size > self.max_bytes_per_key:
                self.refused += 1
                self._full.add(key)
                return False
            held[sender] = bytes(body)
            self._arrived.setdefault(key, {})[sender] = time.monotonic()
            self._version += 1
            self._cond.notify_all()
        return True

    def full(self, key: str) -> bool:
        """Whether ``key`` refused a record for want of room (a flood under fresh keys): whoever relies on pushes
        alone for it must read the DHT as well."""
        with self._cond:
            return key in self._full

    def entries(self, key: str) -> dict[str, bytes]:
        """The records pushed under ``key``, by sender."""
        with self._cond:
            return dict(self._records.get(key, {}))

    def arrived(self, key: str) -> dict[str, float]:
        """When each sender's record under ``key`` landed (``time.monotonic()``): how late a peer was."""
        with self._cond:
            return dict(self._arrived.get(key, {}))

    def poke(self) -> None:
        """Wake :meth:`wait` without a record (for example: a DHT read finished)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a record or a poke since the last call; True if one came."""
        with self._cond:
            if self._version == self._seen:
                self._cond.wait(timeout)
            woke = self._version != self._seen
            self._seen = self._version
            return woke

    def prune(self) -> None:
        """Drop every key no longer wanted."""
        with self._cond:
            for key in [k for k in self._records if not self.wanted(k)]:
                del self._records[key]
                self._arrived.pop(key, None)
            self._full = {k for k in self._full if self.wanted(k)}


class DhtPoll:
    """Polls DHT keys without blocking the waiter: at most one read in flight, started at most every
    ``interval_s``; :meth:`entries` returns the last completed read merged with the inbox (:func:`merge`: a sender
    whose pushed and stored records differ maps to :class:`Both`). A read that finishes pokes the inbox, so a
    waiter on :meth:`Inbox.wait` wakes for it as for a push.

    ``dht``: a started ``hivemind.DHT``; ``on_stuck(what)`` runs when a read outlasts ``timeout_s`` (it raises
    when the DHT process died, else the read is dropped and the next one starts)."""

    def __init__(self, dht: Any, inbox: Inbox, interval_s: float, timeout_s: float,
                 on_stuck: Callable[[str], None]) -> None:
        self.dht, self.inbox = dht, inbox
        self.interval_s, self.timeout_s, self.on_stuck = interval_s, timeout_s, on_stuck
        self._cache: dict[str, dict[str, Any]] = {}
        self._inflight: tuple[tuple[str, ...], list[Any], float] | None = None
        self._started = -1e9  # when the last read began
        self.entries_read = 0  # records the completed reads returned, repeats included: what polling costs

    def entries(self, *keys: str) -> list[dict[str, Any]]:
        """``keys``' entries (subkey -> value) as last read, merged with what was pushed."""
        now = time.monotonic()
        if self._inflight is not None:
            wanted, futures, started = self._inflight
            if wanted != keys:
                self._inflight = None  # another wait's keys: its answer is of no use here
            elif all(f.done() for f in futures):
                for key, future in zip(wanted, futures):
                    self._cache[key] = _entries(future)
                    self.entries_read += len(self._cache[key])
                self._inflight = None
            elif now - started > self.timeout_s:
                self._inflight = None
                self.on_stuck(f"lookup of {', '.join(wanted)}")
            elif now - started > 1.0 and not self.dht.is_alive():
                raise ConnectionError(DHT_DIED)  # a dead DHT process never answers: save and exit, not hang
        fresh = all(k in self._cache for k in keys) and now - self._started < self.interval_s
        if self._inflight is None and not fresh:
            futures = [self.dht.get(key, latest=True, return_future=True) for key in keys]
            for future in futures:
                future.add_done_callback(lambda _f: self.inbox.poke())
            self._inflight = (keys, futures, now)
            self._started = now
        return [merge(self._cache.get(key, {}), self.inbox.entries(key)) for key in keys]

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop cached entries of keys no longer wanted."""
        self._cache = {k: v for k, v in self._cache.items() if keep(k)}


def found_entries(found: Any) -> dict[str, Any]:
    """A DHT lookup's answer as entries (subkey -> value); empty when it found nothing (None or not a dictionary)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {k: getattr(v, "value", v) for k, v in found.value.items()}


def _entries(future: Any) -> dict[str, Any]:
    """A finished DHT lookup's entries; empty when it failed or found nothing."""
    try:
        found = future.result(timeout=0)
    except Exception:  # noqa: BLE001 - a failed lookup reads as "nothing there yet", like a missing record
        return {}
    return found_entries(found)
