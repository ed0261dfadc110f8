"""Atomic writes, and the clean-up of what an interrupted one leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hlbp.peer.common.files import atomic_write_bytes, remove_stale_temps

SAVE_FOREVER = """
import os, sys, tempfile, time
from pathlib import Path
path = Path(sys.argv[1])
fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # as atomic writes name them
os.write(fd, b"x" * 1_000_000)
print("writing", flush=True)
time.sleep(60)
"""


def test_a_killed_save_leaves_a_temp_file_that_a_restart_removes(tmp_path) -> None:
    target = tmp_path / "checkpoint.safetensors"
    atomic_write_bytes(target, b"good")
    proc = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    leftovers = list(tmp_path.glob(".checkpoint.safetensors.*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 1_000_000
    (tmp_path / ".other.bin.x.tmp").write_bytes(b"not ours")
    assert remove_stale_temps(target) == 1
    assert not list(tmp_path.glob(".checkpoint.safetensors.*")) and (tmp_path / ".other.bin.x.tmp").exists()
    assert target.read_bytes() == b"good"  # the last complete save is untouched
