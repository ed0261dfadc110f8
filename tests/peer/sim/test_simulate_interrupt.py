"""Ctrl-C during ``hlbp simulate`` stops every process it started: replicas, their DHT processes and p2pd daemons.

A terminal's Ctrl-C sends SIGINT to the foreground process group; the peers run in sessions of their own, so only
``hlbp simulate`` receives it and must reap the rest. The test does what the terminal does and then looks for any
process that still names the run's working directory on its command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hlbp.peer.sim.launcher import poll

pytestmark = pytest.mark.slow


# `hlbp` with Python's Ctrl-C handler installed: a shell runs background jobs with SIGINT ignored, and a child
# inherits that, so a test run from a backgrounded shell would otherwise send a SIGINT nobody hears
WITH_CTRL_C = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from hlbp.cli.main import main; main()")


def _processes_naming(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone while we looked
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:200]}")
    return found


def test_ctrl_c_reaps_the_whole_swarm(tmp_path: Path) -> None:
    work = tmp_path / "sim"
    sim = subprocess.Popen(
        [sys.executable, "-c", WITH_CTRL_C, "simulate", "--full", "2", "--rounds", "1000", "--inner-steps", "3",
         "--workdir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        # both replicas have joined the run: their DHT processes and daemons are up
        poll(lambda: all((work / f"peer{i}.log").exists() and "replica:" in (work / f"peer{i}.log").read_text()
                         for i in range(2)), 150, "both replicas to start training")
        assert len(_processes_naming(str(work))) >= 4  # at least two replicas plus their daemons
        os.killpg(sim.pid, signal.SIGINT)  # what Ctrl-C in a terminal does to the foreground group
        rc = sim.wait(timeout=60)
        assert rc != 0
        poll(lambda: not _processes_naming(str(work)), 30, "every process of the swarm to exit")
    finally:
        if sim.poll() is None:
            os.killpg(sim.pid, signal.SIGKILL)
