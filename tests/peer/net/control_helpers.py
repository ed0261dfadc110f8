"""Helpers for multi-process control-plane tests: real `hlbp` processes and real p2pd daemons on 127.0.0.1.

Each process runs in its own session, so a test can SIGKILL a whole peer (main process, DHT process and p2pd) the
way a spot instance dies, and teardown can always reap everything it started. Waiting is done by polling with a
deadline, never by sleeping for a fixed time.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hlbp.peer.sim.launcher import LOOPBACK, PeerProcess, poll
from hlbp.peer.sim.zygote import shared_zygote

__all__ = ["LOOPBACK", "Proc", "free_tcp_port", "joiner_peer_id", "poll", "start_bootstrap", "start_joiner", "transport_pair",
           "write_run"]


class Proc(PeerProcess):
    """One `python -m hlbp.cli.control_cmds ...` process (the simulate module's watcher), with test-side names."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(args[0] if args else "hlbp", args, env, zygote=shared_zygote())  # forked, as a swarm's

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        return super().wait_for(pattern, timeout)

    def kill_all(self) -> None:
        """SIGKILL the whole session: the main process, its DHT process and p2pd."""
        self.kill()

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM to the main process only, as `docker stop` does; returns its exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=timeout)


def free_tcp_port() -> int:
    """A port that nothing listens on right now (for an address that must not be dialable)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_run(tmp: Path) -> tuple[Path, Path]:
    """A run config (2 stages, replicas need 1000 tok/s, one peer per stage) and a stand-in tokenizer file."""
    run = tmp / "run.toml"
    run.write_text('run_id = "test-run"\nseed = 3\nn_stages = 2\n[placement]\n'
                   "replica_min_throughput = 1000.0\nmax_peers_per_stage = 1\n")
    tok = tmp / "tokenizer.json"
    # ~300 KB like a real tokenizer.json: more than the 64 KiB a hivemind pipe message may hold
    tok.write_text('{"model": "stand-in tokenizer for control-plane tests", "pad": "' + "x" * 300_000 + '"}')
    return run, tok


def start_bootstrap(spawn: Callable[..., Proc], tmp: Path, ttl: float) -> tuple[Proc, str, str]:
    """(process, full multiaddr, peer id) of a bootstrap on loopback with a persistent identity under ``tmp``."""
    run, tok = write_run(tmp)
    proc = spawn("bootstrap", "--host-maddrs", LOOPBACK, "--identity", str(tmp / "bootstrap.key"),
                 "--run-config", str(run), "--tokenizer", str(tok), "--ttl", str(ttl))
    proc.wait_for("^join with:", timeout=60)
    maddr = proc.wait_for(r"^\s+hlbp join --initial-peers (\S+)").group(1)
    return proc, maddr, maddr.split("/p2p/")[1]


def start_joiner(spawn: Callable[..., Proc], maddr: str, tmp: Path, *extra: str, ttl: float = 10.0,
                 memory_gb: float = 8.0, throughput: float = 500.0, bandwidth: str | None = "1e8") -> Proc:
    """A joiner that holds its role without training, with forced capacity; returns once it announced."""
    args = ["join", "--initial-peers", maddr, "--host-maddrs", LOOPBACK, "--no-train", "--ttl", str(ttl),
            "--memory-gb", str(memory_gb), "--throughput", str(throughput), "--cache-dir", str(tmp / "joincache"),
            "--connect-timeout", "20", "--manifest-timeout", "20"]
    if bandwidth is not None:
        args += ["--bandwidth", bandwidth]
    if "--reachability" not in extra:
        args += ["--reachability", "public"]
    proc = spawn(*args, *extra)
    proc.wait_for("^announced in", timeout=90)
    return proc


def joiner_peer_id(proc: Proc) -> str:
    return proc.wait_for(r"^connected as (\S+)").group(1)




@contextlib.contextmanager
def transport_pair(**holder_options: Any) -> Iterator[tuple[Any, Any]]:
    """A holder and an asker: blob transports on two DHTs (each with its p2pd) on 127.0.0.1, the asker bootstrapped
    from the holder; ``holder_options`` go to the holder's transport. Everything is closed at the end."""
    import hivemind

    from hlbp.peer.net.transport import P2PBlobTransport

    holder_dht = hivemind.DHT(start=True, host_maddrs=[LOOPBACK])
    asker_dht = hivemind.DHT(start=True, host_maddrs=[LOOPBACK],
                             initial_peers=[str(m) for m in holder_dht.get_visible_maddrs()])
    holder, asker = P2PBlobTransport(holder_dht, **holder_options), P2PBlobTransport(asker_dht)
    try:
        yield holder, asker
    finally:
        for t in (holder, asker):
            t.close()
        for d in (asker_dht, holder_dht):
            d.shutdown()
