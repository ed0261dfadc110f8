"""Atomic file writes, shared by the data caches, checkpoints, summaries and benchmark results."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on a clean exit it is fsynced and renamed over ``path``, so
    readers see the old file or the new one, never a torn one. On an error it is deleted. Its name is what
    :func:`remove_stale_temps` looks for when a process was killed before either happened."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def remove_stale_temps(path: Path) -> int:
    """Delete the temporary files that interrupted atomic writes of ``path`` left behind; returns how many.

    A process killed mid-save (SIGKILL, a reclaimed spot instance) leaves its ``.<name>.*.tmp`` file, as large as
    the checkpoint itself; a restart calls this before it writes anything, so the leftovers cannot pile up.
    """
    path = Path(path)
    removed = 0
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            stale.unlink()
            removed += 1
        except OSError:
            pass  # gone already, or not ours to delete: the next save does not depend on it
    return removed
