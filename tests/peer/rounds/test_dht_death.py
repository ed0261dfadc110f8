"""A replica whose DHT process dies says so in one line, saves its checkpoint and exits, instead of hanging.

hivemind's DHT runs in a child process; when it dies (OOM killer, a crash), no call into it is ever answered.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hlbp.peer.sim.launcher import SimConfig, Swarm, poll

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # a bound on a couple of rounds on 2 busy cores, not an expected duration


def _forked_children(pid: int) -> list[int]:
    """Child processes of ``pid`` forked from it (same command line): the DHT process, not p2pd or torch's helper."""
    parent = Path(f"/proc/{pid}/cmdline").read_bytes()
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if Path(f"/proc/{child}/cmdline").read_bytes() == parent:
                    out.append(int(child))
            except OSError:
                continue
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the DHT process")
def test_dead_dht_process_is_one_line_a_checkpoint_and_an_exit(tmp_path: Path) -> None:
    cfg = SimConfig(n_full=0, rounds=50, inner_steps=3, batch_size=4, seq_len=64, round_deadline_s=1.0,
                    min_deadline_s=1.0, max_deadline_s=3.0, seed=13, threads=1, run_id="dht-death", ttl_s=10.0)
    with Swarm(cfg, tmp_path) as sw:
        sw.start()
        replica = sw.add("a")
        poll(lambda: len(replica.rounds()) >= 1, TIMEOUT_S, lambda: f"a to finish a round\n{replica.proc.output[-3000:]}")
        kids: list[int] = []

        def one_child() -> int | None:  # a short-lived fork (if any) must not be mistaken for the DHT process
            kids[:] = _forked_children(replica.proc.popen.pid)
            return kids[0] if len(kids) == 1 else None

        dht_pid = poll(one_child, 30, f"exactly one forked child (the DHT process); last seen {kids}")
        os.kill(dht_pid, signal.SIGKILL)
        poll(lambda: not replica.proc.alive, 60, lambda: f"a to exit after its DHT died\n{replica.proc.output[-3000:]}")
        assert replica.proc.popen.returncode == 1, replica.proc.output[-3000:]
        assert replica.proc.find(r"^error: the DHT process of this peer died; restart the peer")
        assert "Traceback" not in replica.proc.output
        checkpoint = replica.metrics_path().parent / "checkpoint.safetensors"  # saved on the way out
        assert checkpoint.exists()
