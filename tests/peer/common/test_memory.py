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
