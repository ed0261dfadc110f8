"""The memory figures every round's metrics record carries, and the trim that gives freed heap memory back."""

from __future__ import annotations

import sys

import torch

from hlbp.peer.common import memory


def test_peak_and_current_resident_set_see_a_large_allocation() -> None:
    before = memory.peak_host_bytes()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert memory.current_host_bytes() >= 48 << 20
    assert memory.peak_host_bytes() >= max(before, memory.current_host_bytes())
    del block
    if sys.platform.startswith("linux"):
        assert memory.trim() is True


def test_the_first_baseline_mark_wins_and_the_snapshot_carries_it() -> None:
    first = memory.mark_baseline()
    assert memory.mark_baseline() == first == memory.baseline_host_bytes() > 0
    snap = memory.snapshot()
    assert snap["base_host_bytes"] == first and snap["peak_host_bytes"] >= first
    assert snap["peak_device_bytes"] == (torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0)


def _run_fresh(code: str) -> str:
    """The last two words ``code`` prints, run in a fresh interpreter (glibc's allocator state is per process)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return " ".join(out.stdout.split()[-2:])


def _held_after_free(mapped: bool) -> str:
    """In a fresh process: free a 16 MiB buffer (glibc's adaptive threshold rises to its size), then allocate and
    touch 8 MiB, keep a small tensor allocated after it and free the 8 MiB; print whether mapping was set and whether
    those 8 MiB are still resident (a hole below a live allocation, which trimming the heap's top cannot return)."""
    return _run_fresh("from hlbp.peer.common import memory; import torch;"
                      f"ok = memory.map_large_allocations() if {mapped} else None;"
                      "a = torch.ones(4 << 20); del a; before = memory.current_host_bytes();"
                      "b = torch.ones(2 << 20); keep = torch.ones(1 << 16); del b;"
                      "print(ok, memory.current_host_bytes() - before > 4 << 20)")


def test_large_allocations_mapped_on_their_own_go_back_when_freed() -> None:
    """What a peer training on a GPU sets: an 8 MiB buffer freed after a larger one is returned at once, where
    glibc's adaptive threshold keeps it (the control, so that the test can tell the two apart)."""
    if not sys.platform.startswith("linux"):
        assert _held_after_free(True) == "False False"
        return
    assert _held_after_free(False) == "None True"
    assert _held_after_free(True) == "True False"


def _reused_across_threads(limited: bool) -> str:
    """In a fresh process: a second thread allocates 8 MiB and frees it below a live small tensor (after a 16 MiB
    buffer raised glibc's adaptive threshold, so both live in a heap); then the main thread allocates 6 MiB. Print
    whether the arenas were limited and whether that 6 MiB took new memory (the thread's hole was not reused)."""
    return _run_fresh("from hlbp.peer.common import memory; import torch, threading;"
                      f"ok = memory.limit_arenas() if {limited} else None;"
                      "a = torch.ones(4 << 20); del a; keep = [];"
                      "t = threading.Thread(target=lambda: (keep.append(torch.ones(2 << 20)),"
                      " keep.append(torch.ones(1 << 16)), keep.pop(0))); t.start(); t.join();"
                      "before = memory.current_host_bytes(); c = torch.ones(3 << 19);"
                      "print(ok, memory.current_host_bytes() - before > 3 << 20)")


def test_one_arena_lets_a_thread_reuse_what_another_freed() -> None:
    """What every hlbp process sets at start: memory the exchange thread freed serves the training thread's next
    allocation, where by default each thread's arena keeps its own free space (the control)."""
    if not sys.platform.startswith("linux"):
        assert _reused_across_threads(True) == "False False"
        return
    assert _reused_across_threads(False) == "None True"
    assert _reused_across_threads(True) == "True False"
