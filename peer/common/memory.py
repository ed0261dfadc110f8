"""How much memory this process holds: its peak resident set, and the part of it the model's state takes.

A peer's memory budget is stated per parameter (docs/design.md, "Memory"): the bytes a role holds for each
parameter it trains. The Python interpreter, torch and hivemind cost a few hundred MiB whatever the model, so the
budget is measured above a **baseline**: the resident set just before the peer builds its model, marked once by
:func:`mark_baseline`. Every round's metrics record carries the peak and the baseline, and ``hlbp bench memory``
divides their difference by the parameters held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

_baseline: int | None = None
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: no glibc here


def _max_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def current_host_bytes() -> int:
    """The process's resident set now, in bytes (Linux ``/proc/self/statm``; the peak where that is absent)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _max_rss()


def peak_host_bytes() -> int:
    """The largest resident set this process has had, in bytes: ``ru_maxrss``, or the resident set now where that
    is larger (the kernel folds each thread's latest pages into the peak a little late)."""
    return max(_max_rss(), current_host_bytes())


def mark_baseline(device: Any = None, warm: Callable[[], None] | None = None) -> int:
    """Remember the resident set now as the baseline the model's state is measured above (the first mark wins:
    a process builds one model) and return it. ``warm`` runs first (a throwaway step that loads what the runtime
    loads on first use: its host memory is a fixed cost of the process, not of the model), and the memory it freed
    goes back to the system (:func:`trim`) before the resident set is read, so the baseline holds no free heap the
    model would then fill unseen. On a CUDA ``device`` its context is created first, and large host allocations
    are mapped on their own from here (:func:`map_large_allocations`)."""
    global _baseline
    if _baseline is None:
        if getattr(device, "type", None) == "cuda":
            import torch

            map_large_allocations()
            torch.empty(1, device=device)
        if warm is not None:
            warm()
            trim()
        _baseline = current_host_bytes()
    return _baseline


def baseline_host_bytes() -> int:
    """The baseline :func:`mark_baseline` took (0 when none was: the whole resident set counts)."""
    return _baseline or 0


def peak_device_bytes() -> int:
    """The most CUDA memory torch has allocated in this process (0 without CUDA, or when torch is not loaded)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.max_memory_allocated())


M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
M_ARENA_MAX = -8
MAP_LARGE_BYTES = 1 << 20


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        try:
            _libc = ctypes.CDLL(name) if name else None
        except OSError:
            _libc = None
    return _libc if isinstance(_libc, ctypes.CDLL) else None


def map_large_allocations(threshold: int = MAP_LARGE_BYTES) -> bool:
    """Have glibc map every allocation of ``threshold`` bytes or more on its own, so that freeing it returns it
    to the system at once; returns whether that was set.

    For a peer that trains on a GPU: its host then allocates only the round's tensors (the anchor, a contribution's
    buffers, a round's result), large and few, and glibc's adaptive threshold otherwise lets them fragment its heap
    (measured on the small model on the CPU: 7 bytes per parameter more at the peak). A peer that trains on the CPU
    keeps the adaptive threshold: there every inner step's activations would be mapped and unmapped, 22-37 % slower
    per step."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def limit_arenas(arenas: int = 1) -> bool:
    """Have glibc serve every thread from at most ``arenas`` heaps; returns whether that was set. Call it first
    thing in a process, before a second thread allocates (a thread keeps the arena it was given).

    glibc gives threads that allocate at once their own arenas, and memory freed in one is never reused by
    another. A full replica's exchange thread builds a round's new parameters while the training thread runs
    steps, so each held its own model-sized free space: measured on the small model through 3 overlapped rounds,
    a full replica peaked 3-4 bytes per parameter lower with one arena, at the same inner step speed (``hlbp
    train`` on the small model: 13.3-13.6 s for 40 steps either way)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))


def trim() -> bool:
    """Give the heap memory freed so far back to the operating system (glibc's ``malloc_trim``; elsewhere
    nothing), and return whether that ran.

    A round frees model-sized buffers (a contribution's transients, the anchor a round replaced). glibc keeps freed
    memory of that size in its heap after its adaptive mmap threshold has grown past it, so the resident set holds
    every such buffer once more than the round needs: measured on the small model, 9 bytes per parameter. A fixed
    threshold instead (``MALLOC_MMAP_THRESHOLD_``) made every inner step 37 % slower; a trim after each round's
    large frees costs milliseconds."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def snapshot() -> dict[str, int]:
    """The fields a metrics record carries: peak and baseline host bytes, peak device bytes."""
    return {"peak_host_bytes": peak_host_bytes(), "base_host_bytes": baseline_host_bytes(),
            "peak_device_bytes": peak_device_bytes()}
