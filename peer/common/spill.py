"""Tensors kept in a file instead of in the process's memory: state a peer touches once a round, not every step.

A full replica's error-feedback buffer is read and written once per parameter per round (when a contribution is
made, and when a straggler's is given back), yet held in memory it costs 2-4 bytes per parameter for the whole run
(docs/design.md, "Memory per parameter"). Here each tensor has a slot in an unlinked temporary file: a write puts
its bytes there, a read makes a fresh tensor from them, so the process holds one parameter's copy at a time. The
kernel keeps the file's pages in its cache while memory is free (a read is a copy from the cache) and writes them
out when it is not; either way they are not the process's resident set, and they go when the file is closed or the
process dies.

Reads return new tensors: changing one in place changes nothing in the store; write it back.

Disk space is taken when a slot is made (``posix_fallocate``), not when its bytes are first written: a full disk
shows as :class:`NoRoomError` where the store grows, and once the slots exist (after a round; they are reused after)
no later write can fail for want of space. :func:`require_room` checks before a peer starts that the folder has room
for what it will keep there.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from hlbp.peer.common.errors import UserInputError

BLOCK_BYTES = 4 << 20
"""What :meth:`SpilledTensors.gather`, :meth:`SpilledTensors.scatter` and :meth:`SpilledTensors.stream` read of a
slot at a time."""


@dataclass(frozen=True)
class Streamed:
    """A tensor handed out a block at a time: its dtype and shape, and its values flat, in order, in ``blocks``. A
    block may be overwritten by the next one (one buffer serves them all): use each before asking for the next."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: Iterator[torch.Tensor]


@runtime_checkable
class Streams(Protocol):
    """A mapping of tensors that can hand one out a block at a time (:class:`Streamed`)."""

    def stream(self, name: str) -> Streamed:
        """Tensor ``name``, a block at a time."""
        ...


def stream_of(tensors: Mapping[str, torch.Tensor], name: str) -> Streamed:
    """``tensors[name]`` a block at a time where the mapping can (:class:`Streams`: a tensor kept in a file is not
    read whole), else the whole tensor, on the host, as one block. A reader that goes over every value once (a
    checksum, a checkpoint's write, a finiteness check) then holds a block of a kept tensor, not the tensor: for the
    largest parameter of the small model that is 4 MiB instead of 16 (a full replica's peak was at a checkpoint)."""
    if isinstance(tensors, Streams):
        return tensors.stream(name)
    t = tensors[name].detach().contiguous().cpu()
    return Streamed(t.dtype, tuple(t.shape), iter((t.reshape(-1),)))


class ChangedWhileStreamed(RuntimeError):
    """A tensor was rewritten while it was handed out a block at a time: its blocks would mix two values."""


class NoRoomError(UserInputError):
    """The disk under a spill folder cannot hold what is to be kept there. The message names the folder, the bytes
    and what to do (free space, another ``--out-dir``, or ``--state-in-memory``)."""


def require_room(directory: str | Path, nbytes: int, what: str) -> None:
    """Raise :class:`NoRoomError` unless the file system under ``directory`` has ``nbytes`` free for this user.
    ``what`` says what the bytes are for, in the message."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise NoRoomError(f"{what} needs {nbytes / 2**20:,.0f} MiB under {directory}, which has "
                          f"{free / 2**20:,.0f} MiB free: free some space, give another --out-dir, or keep it in "
                          "memory with --state-in-memory")


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SpilledTensors(MutableMapping[str, torch.Tensor]):
    """name -> CPU tensor, kept in a file under ``directory`` (the system's temporary directory when None).

    A name rewritten with a tensor of the same size keeps its slot; a slot left by a name removed or resized is
    reused by the next tensor of that size. Safe to use from several threads."""

    def __init__(self, directory: str | Path | None = None) -> None:
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._dir = str(directory) if directory is not None else tempfile.gettempdir()
        self._file = tempfile.TemporaryFile(dir=directory, prefix="hlbp-spill-")  # noqa: SIM115 - lives with the store
        self._fd = self._file.fileno()
        self._slots: dict[str, _Slot] = {}
        self._free: dict[int, list[int]] = {}  # nbytes -> offsets of unused slots of that size
        self._end = 0
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._lock:
            slot = self._slots[name]
            buf = torch.empty(slot.nbytes, dtype=torch.uint8)
            _read_exactly(self._fd, buf, slot.offset)
        return buf.view(slot.dtype).reshape(slot.shape)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        with self._lock:
            old = self._slots.get(name)
            if old is not None and old.nbytes == nbytes:
                offset = old.offset
            else:
                if old is not None:
                    self._free.setdefault(old.nbytes, []).append(old.offset)
                offset = self._take(nbytes)
            _write_exactly(self._fd, t, offset)
            self._slots[name] = _Slot(offset, nbytes, t.dtype, tuple(t.shape))

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape of the tensor kept as ``name``, without reading it."""
        with self._lock:
            slot = self._slots[name]
        return slot.dtype, slot.shape

    def stream(self, name: str) -> Streamed:
        """Tensor ``name`` a block of :data:`BLOCK_BYTES` at a time, each read into the same buffer when asked for
        (:class:`Streamed`). Raises :class:`ChangedWhileStreamed` from the blocks if ``name`` is written meanwhile:
        the caller keeps writers away while it reads."""
        with self._lock:
            slot = self._slots[name]
        return Streamed(slot.dtype, slot.shape, self._stream_blocks(name, slot))

    def _stream_blocks(self, name: str, slot: _Slot) -> Iterator[torch.Tensor]:
        size = max(1, slot.dtype.itemsize)
        per = max(1, BLOCK_BYTES // size) * size
        buf = torch.empty(min(per, slot.nbytes), dtype=torch.uint8)
        for lo in range(0, slot.nbytes, per):
            part = buf[:min(per, slot.nbytes - lo)]
            with self._lock:
                if self._slots.get(name) is not slot:
                    raise ChangedWhileStreamed(f"{name} was written while it was read a block at a time")
                _read_exactly(self._fd, part, slot.offset + lo)
            yield part.view(slot.dtype)

    def gather(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """The values of ``name`` at the flat ``positions`` (sorted, unique, int64), read a block of the slot at a
        time (:data:`BLOCK_BYTES`): the process holds one block, not the tensor."""
        with self._lock:
            slot = self._slots[name]
            out = torch.empty(positions.numel(), dtype=slot.dtype)
            for lo, block, i, j in self._blocks(slot, positions):
                out[i:j] = block[positions[i:j] - lo]
        return out

    def scatter(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (the stored dtype) at the flat ``positions`` (sorted, unique, int64) of ``name``, a
        block at a time: only the blocks that hold a position are read and written back."""
        with self._lock:
            slot = self._slots[name]
            if values.dtype != slot.dtype or values.shape != positions.shape:
                raise ValueError(f"scatter into {name}: {values.dtype} {tuple(values.shape)} values for "
                                 f"{tuple(positions.shape)} positions of a {slot.dtype} slot")
            for lo, block, i, j in self._blocks(slot, positions):
                block[positions[i:j] - lo] = values[i:j]
                _write_exactly(self._fd, block, slot.offset + lo * block.element_size())

    def _blocks(self, slot: _Slot, positions: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, int, int]]:
        """Per block of ``slot`` that holds one of ``positions``: its first element, its values as read, and the
        range of ``positions`` inside it. Positions must be sorted, unique and within the slot."""
        size = slot.dtype.itemsize
        numel = slot.nbytes // size if size else 0
        if positions.numel() and (int(positions[0]) < 0 or int(positions[-1]) >= numel
                                  or not bool((positions[1:] > positions[:-1]).all())):
            raise ValueError("positions must be sorted, unique and inside the tensor")
        per = max(1, BLOCK_BYTES // size)
        for b in torch.unique_consecutive(positions // per).tolist():
            lo, hi = b * per, min(numel, (b + 1) * per)
            i, j = torch.searchsorted(positions, torch.tensor([lo, hi], dtype=positions.dtype)).tolist()
            buf = torch.empty((hi - lo) * size, dtype=torch.uint8)
            _read_exactly(self._fd, buf, slot.offset + lo * size)
            yield lo, buf.view(slot.dtype), i, j

    def __delitem__(self, name: str) -> None:
        with self._lock:
            slot = self._slots.pop(name)
            self._free.setdefault(slot.nbytes, []).append(slot.offset)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._slots))

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def clear(self) -> None:
        """Forget every tensor and give the file's space back."""
        with self._lock:
            self._slots.clear()
            self._free.clear()
            self._end = 0
            os.ftruncate(self._fd, 0)

    def nbytes(self) -> int:
        """The bytes the stored tensors take in the file."""
        with self._lock:
            return sum(s.nbytes for s in self._slots.values())

    def file_bytes(self) -> int:
        """The file's size: the stored bytes plus the free slots kept for reuse."""
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        """Remove the file (it is removed anyway when the process ends)."""
        self._file.close()

    def _take(self, nbytes: int) -> int:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        offset = self._end
        if nbytes:
            try:
                os.posix_fallocate(self._fd, offset, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise NoRoomError(f"no room under {self._dir} for {nbytes:,} more bytes of round state "
                                  f"({self._end:,} held there): free some space, give another --out-dir, "
                                  "or keep it in memory with --state-in-memory") from exc
        self._end += nbytes
        return offset


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (an empty tensor's are empty)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _write_exactly(fd: int, t: torch.Tensor, offset: int) -> None:
    view = bytes_of(t)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _read_exactly(fd: int, buf: torch.Tensor, offset: int) -> None:
    view = memoryview(buf.numpy()) if buf.numel() else memoryview(bytearray())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"the spill file ended {len(view) - done} bytes short of a tensor at offset {offset}")
        done += n
