"""How much a piece of work grows a fresh process's peak resident set: a script sets it up in a process of its own,
frees what it can, resets the peak through ``/proc/self/clear_refs``, runs the work, and prints the peak
(``VmHWM``) over the resident set just before it, in MiB.

The process's allocator gives every block of 1 MiB or more back to the system when it is freed
(``MALLOC_MMAP_THRESHOLD_``): by default glibc raises that threshold after the first large free and then keeps freed
blocks of up to 32 MiB in its heaps, so the peak read the tensors live at once plus whatever the heaps happened to
keep, 390-530 MiB for the same 390 MiB of tensors from one run to the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

needs_clear_refs = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")


_MEASURED = """
import gc, json
from pathlib import Path
from hlbp.peer.common.memory import current_host_bytes, trim
gc.collect()
trim()
before = current_host_bytes()
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
{work}
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({{"grown_mib": (peak - before) / 2**20}}))
"""


def peak_growth_mib(setup: str, work: str, folder: Path) -> float:
    """MiB the peak resident set grows by while ``work`` runs after ``setup`` (Python source; ``sys.argv[1]`` is
    ``folder``), in a process of its own."""
    script = textwrap.dedent(setup) + _MEASURED.format(work=textwrap.dedent(work))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300,
                          check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["grown_mib"])
