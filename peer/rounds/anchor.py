"""The anchor: the global parameters every in-sync replica agrees on, replaced one parameter at a time, with
snapshots of earlier versions kept as undo records instead of whole copies.

A round's result replaces the anchor while other parts still read the parameters it replaces: under eager overlap
the inner phase under way started from them (``EagerStart``), a preview or the round report reads them, and a
refused round must put them back. Holding the old tensors for them kept two anchors, 4 bytes per parameter more
at every round's peak (docs/design.md, "Memory per parameter"). Here a round replaces each parameter as soon as its
new value is computed, and the old tensor goes at once; a :class:`Snapshot` taken before reads the old value back
from an undo record: the positions that changed and their old values (a SparseLoCo round changes about
contributors x 1.6 % of them), or the old tensor itself where most changed (DiLoCo). Records are kept only while a
snapshot that needs them lives.

Tensors are replaced, never changed in place, so a tensor read from the anchor stays that version's for as long as
the reader holds it; reads and replacements may come from different threads.

The current tensors live in memory, or in a store that keeps them in a file (hlbp.peer.common.spill: each read is
a fresh tensor, so a reader holds its copy only while it reads): the anchor is read a few times a round, not at
every step, so on disk it costs the process no memory between reads.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import torch

from hlbp.peer.common.spill import SpilledTensors, Streamed, stream_of

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DENSE_FRACTION = 1 / 3  # above this fraction of positions changed, an undo record keeps the old tensor instead


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (so that -0.0 differs from 0.0, and a NaN equals itself)."""
    return t.detach().view(_BITS[t.element_size()])


@dataclass(frozen=True)
class Undo:
    """How to take one parameter back from the value written at ``version`` to the one before: ``values`` at the
    flat ``positions`` (None: ``values`` is the whole old tensor)."""

    version: int
    values: torch.Tensor
    positions: torch.Tensor | None = None

    @staticmethod
    def between(version: int, old: torch.Tensor, new: torch.Tensor) -> Undo:
        """The record that turns ``new`` back into ``old`` bit for bit."""
        if old.shape != new.shape or old.dtype != new.dtype:
            return Undo(version, old)
        changed = (_bits(old) != _bits(new)).reshape(-1)
        count = int(changed.sum())
        if count > DENSE_FRACTION * changed.numel():
            return Undo(version, old)
        positions = changed.nonzero().reshape(-1)
        return Undo(version, old.detach().reshape(-1)[positions].clone(), positions)


class Anchor(Mapping[str, torch.Tensor]):
    """The current global parameters (name -> tensor), written with :meth:`__setitem__` / :meth:`update`, read
    as now or as at an earlier :meth:`snapshot`. ``spill_dir``: keep them in a file under it, not in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = (),
                 spill_dir: str = "") -> None:
        self.spill_dir = spill_dir
        self._now: MutableMapping[str, torch.Tensor] = SpilledTensors(spill_dir) if spill_dir else {}
        self._lock = threading.RLock()
        self._version = 0
        self._written: dict[str, int] = {}  # the version of each parameter's last write
        self._undo: dict[str, list[Undo]] = {}
        self._held: weakref.WeakSet[Snapshot] = weakref.WeakSet()
        for name, value in (tensors.items() if isinstance(tensors, Mapping) else tensors):
            self._now[name] = value

    def emptied(self) -> Anchor:
        """A new, empty anchor kept where this one is (in memory, or in a new file beside this one's)."""
        return Anchor(spill_dir=self.spill_dir)

    @property
    def version(self) -> int:
        """How many parameter writes the anchor has had."""
        return self._version

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._now[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._now))

    def __len__(self) -> int:
        return len(self._now)

    def __contains__(self, name: object) -> bool:
        return name in self._now

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        """Replace one parameter; the old tensor is kept (as an undo record) only for the snapshots that need it."""
        self.put(name, value)

    def put(self, name: str, value: torch.Tensor, current: torch.Tensor | None = None) -> None:
        """:meth:`__setitem__`, given the ``current`` value the writer has just read (the anchor's only writer is
        one thread): the undo record is taken from it, where a kept file would be read once more."""
        with self._lock:
            self._version += 1
            if name in self._now and self._oldest_held() < self._version:
                old = current if current is not None else self._now[name]
                self._undo.setdefault(name, []).append(Undo.between(self._version, old, value))
            self._now[name] = value
            self._written[name] = self._version

    def stream(self, name: str) -> Streamed:
        """Parameter ``name``'s current value a block at a time (:func:`~hlbp.peer.common.spill.stream_of`): a
        spilled one is not read whole."""
        return stream_of(self._now, name)

    def values_at(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s current values at the flat ``positions`` (sorted, unique, int64), as float32: a
        spilled parameter is read a block at a time, not whole."""
        if isinstance(self._now, SpilledTensors):
            return self._now.gather(name, positions).float()
        return self._now[name].detach().reshape(-1)[positions].float()

    def put_at(self, name: str, positions: torch.Tensor, values: torch.Tensor,
               current: torch.Tensor | None = None) -> None:
        """Write float32 ``values`` at the flat ``positions`` (sorted, unique, int64) of parameter ``name`` and
        leave the rest as it is: bit for bit :meth:`put` of the whole tensor so changed. ``current``: the values
        at ``positions`` the writer has just read (:meth:`values_at`; the anchor's only writer is one thread), for
        the undo record, where the file would be read there once more.

        A round's sparse update changes a few percent of each parameter. Kept in a file, the parameter is changed
        there a block at a time, so no copy of it, old or new, is made (the undo record a held snapshot needs is
        the old values at ``positions``); in memory the new tensor is a copy, as with :meth:`put`. A parameter
        stored in another dtype than float32, or changed at more than :data:`DENSE_FRACTION` of its positions, is
        replaced whole."""
        with self._lock:
            store = self._now
            if isinstance(store, SpilledTensors):
                dtype, shape = store.meta(name)
                if dtype == torch.float32 and positions.numel() <= DENSE_FRACTION * math.prod(shape):
                    self._version += 1
                    if self._oldest_held() < self._version:
                        old_at = current if current is not None else store.gather(name, positions)
                        self._undo.setdefault(name, []).append(Undo(self._version, old_at, positions))
                    store.scatter(name, positions, values)
                    self._written[name] = self._version
                    return
            old = store[name]
            new = old.detach().float().clone(memory_format=torch.contiguous_format)
            new.view(-1)[positions] = values
            self.put(name, new, old)

    def unchanged_since(self, names: Iterable[str], version: int) -> bool:
        """Whether none of ``names`` was written after ``version`` (what a reader of that version may still read
        as now)."""
        with self._lock:
            return all(self._written.get(n, 0) <= version for n in names)

    def update(self, other: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        """Replace each given parameter in turn (:meth:`__setitem__`)."""
        for name, value in (other.items() if isinstance(other, Mapping) else other):
            self[name] = value

    def snapshot(self) -> Snapshot:
        """The parameters as they are now, readable after later writes (one parameter at a time when read)."""
        with self._lock:
            snap = Snapshot(self, self._version, tuple(self._now))
            self._held.add(snap)
            weakref.finalize(snap, self._prune)
            return snap

    def restore(self, snap: Snapshot) -> None:
        """Put back every parameter written since ``snap`` was taken (a refused round)."""
        for name in snap:
            if self._undo_since(name, snap.version):
                self[name] = snap[name]

    def read(self, name: str, version: int) -> torch.Tensor:
        """Parameter ``name`` as it was at ``version`` (the current tensor itself when unchanged since)."""
        with self._lock:
            t = self._now[name]
            records = self._undo_since(name, version)
        value, owned = t, isinstance(self._now, SpilledTensors)  # a spilled read is a fresh tensor: ours to change
        for record in reversed(records):  # newest first, each back to the value before its write
            if record.positions is None:
                value, owned = record.values, False
            else:
                if not owned:
                    value, owned = value.detach().clone(memory_format=torch.contiguous_format), True
                value.view(-1)[record.positions] = record.values
        return value

    def read_at(self, name: str, version: int, positions: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s values at the flat ``positions`` (sorted, unique, int64) as they were at
        ``version``, as float32: bit for bit ``read(name, version)`` there, with a spilled parameter read at those
        positions a block at a time, not whole."""
        with self._lock:
            value = self.values_at(name, positions)
            records = self._undo_since(name, version)
        for record in reversed(records):  # newest first, each back to the value before its write
            if record.positions is None:
                value = record.values.detach().reshape(-1)[positions].float()
            elif record.positions.numel() and positions.numel():
                at = torch.searchsorted(record.positions, positions).clamp_(max=record.positions.numel() - 1)
                hit = record.positions[at] == positions
                value[hit] = record.values[at[hit]].float()
        return value

    def changed_since(self, name: str, version: int) -> torch.Tensor | None:
        """The flat positions (sorted, unique, int64) at which parameter ``name`` was written after ``version``
        (a superset: every write since, whatever later snapshot it is compared with); None where that is not known
        position by position: a whole tensor was replaced, or a write was kept without an undo record because no
        snapshot as old as ``version`` was held."""
        with self._lock:
            records = self._undo_since(name, version)
            if any(r.positions is None for r in records):
                return None
            if self._written.get(name, 0) > version and not any(r.version == self._written[name] for r in records):
                return None
            if not records:
                return torch.empty(0, dtype=torch.int64)
            return torch.unique(torch.cat([r.positions for r in records]), sorted=True)

    def _undo_since(self, name: str, version: int) -> list[Undo]:
        with self._lock:
            return [u for u in self._undo.get(name, ()) if u.version > version]

    def _oldest_held(self) -> float:
        versions = [s.version for s in list(self._held)]
        return min(versions) if versions else float("inf")

    def _prune(self) -> None:
        """Drop the undo records no live snapshot needs (a record is needed by snapshots older than its write)."""
        with self._lock:
            oldest = self._oldest_held()
            for name in list(self._undo):
                kept = [u for u in self._undo[name] if u.version > oldest]
                if kept:
                    self._undo[name] = kept
                else:
                    del self._undo[name]

    def held_records(self) -> int:
        """How many undo records are kept now (what snapshots still need)."""
        with self._lock:
            return sum(len(v) for v in self._undo.values())


class Snapshot(Mapping[str, torch.Tensor]):
    """The anchor as it was at one version; each read makes that parameter's value (the current tensor when it has
    not been written since, else a copy with the undo records applied)."""

    def __init__(self, anchor: Anchor, version: int, names: tuple[str, ...]) -> None:
        self._anchor, self.version, self._names = anchor, version, names
        self._known = frozenset(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._anchor.read(name, self.version)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def values_at(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """This version's float32 values of ``name`` at the flat ``positions`` (sorted, unique, int64), without
        reading the parameter whole (:meth:`Anchor.read_at`)."""
        if name not in self._known:
            raise KeyError(name)
        return self._anchor.read_at(name, self.version, positions)

    def changed_since(self, earlier: Snapshot, name: str) -> torch.Tensor | None:
        """The flat positions (sorted, unique, int64; a superset) at which ``name`` may differ between ``earlier``
        and this snapshot; None where that is not known position by position (another anchor, ``earlier`` taken
        after this one, a whole tensor replaced since)."""
        if not earlier.taken_from(self._anchor) or earlier.version > self.version or name not in self._known:
            return None
        return self._anchor.changed_since(name, earlier.version)

    def taken_from(self, anchor: Anchor) -> bool:
        """Whether this is a snapshot of ``anchor`` (versions of two anchors are not comparable)."""
        return self._anchor is anchor

    # a snapshot is one handle on one version: compared by identity (a Mapping would compare every tensor)
    __eq__ = object.__eq__
    __hash__ = object.__hash__
