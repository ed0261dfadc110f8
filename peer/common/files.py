"""Atomic file writes, shared by the data caches, checkpoints, summaries and benchmark results."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
