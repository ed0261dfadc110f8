"""Two peers that dial each other at the same moment both get a connection.

With go-libp2p's default port reuse, such a pair makes one TCP connection by simultaneous open on which both sides
speak first; both dials fail and each side backs off from the other for seconds (seen in a ``hlbp simulate`` run: a
stage peer and a replica never reached each other again, were left out of both rounds and the stage fell out of
sync). hlbp's DHT process starts its p2pd without port reuse (``P2PD_ENV``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from hlbp.peer.net.control import NetworkConfig, connect_dht
from hlbp.peer.net.dht import P2PD_ENV
from hlbp.peer.net.reach import Dialer
from hlbp.peer.net.validation import load_or_create_identity, record_validator

pytestmark = pytest.mark.slow

PAIRS = 15
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_the_dht_process_starts_its_p2pd_without_port_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in P2PD_ENV:
        monkeypatch.delenv(name, raising=False)  # what the DHT process inherits lacks it: it sets it itself
    key = tmp_path / "peer.key"
    load_or_create_identity(key)
    dht = connect_dht(NetworkConfig(host_maddrs=[LOOPBACK]), key, record_validator())
    try:
        deadline, daemons = time.monotonic() + 30, []
        while not daemons and time.monotonic() < deadline:  # the daemon is a child of the DHT process
            daemons = [c for c in _children(dht.pid) if b"p2pd" in Path(f"/proc/{c}/cmdline").read_bytes()]
            time.sleep(0.1)
        assert daemons, "no p2pd under the DHT process"
        for pid in daemons:
            env = _environ(pid)
            assert {k: env.get(k) for k in P2PD_ENV} == P2PD_ENV
    finally:
        dht.shutdown()


def test_daemons_with_that_environment_dial_each_other_at_once_and_both_connect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in P2PD_ENV.items():
        monkeypatch.setenv(name, value)  # P2P.create starts its p2pd from this process, as the DHT process does

    async def pair() -> list[bool]:
        a, b = await P2P.create(host_maddrs=[LOOPBACK]), await P2P.create(host_maddrs=[LOOPBACK])
        try:
            at = {str(p.peer_id): [str(m).split("/p2p/")[0] for m in await p.get_visible_maddrs()] for p in (a, b)}
            dial_a = Dialer(a.daemon_listen_maddr, lambda peer: at[peer])
            dial_b = Dialer(b.daemon_listen_maddr, lambda peer: at[peer])
            return list(await asyncio.gather(dial_a.connect(str(b.peer_id), 10.0),
                                             dial_b.connect(str(a.peer_id), 10.0)))
        finally:
            await a.shutdown()
            await b.shutdown()

    async def run() -> list[list[bool]]:
        return [await pair() for _ in range(PAIRS)]

    assert asyncio.run(run()) == [[True, True]] * PAIRS
