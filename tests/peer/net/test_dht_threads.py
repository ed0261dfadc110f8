"""A DHT started by hlbp survives records above 4 KiB, also written from several threads at once.

A joined replica calls its DHT from the round runner, the heartbeat and (dense runs) hivemind's averager. With
hivemind's own DHT, concurrent writes above PIPE_BUF interleave in its command pipe, and its process reads that pipe
non-blocking, so it can wake in the middle of one large message: either way it dies on the garbled bytes (both
seen with this test against plain ``hivemind.DHT``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from hlbp.peer.net.control import NetworkConfig, connect_dht
from hlbp.peer.net.validation import load_or_create_identity, record_validator

pytestmark = pytest.mark.slow

THREADS, STORES, VALUE_BYTES = 6, 40, 20_000
LARGE_BYTES, LARGE_STORES = 200_000, 20  # larger than the pipe's 64 KiB buffer


def test_concurrent_large_stores_keep_the_dht_alive(tmp_path: Path) -> None:
    key = tmp_path / "peer.key"
    load_or_create_identity(key)
    net = NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = connect_dht(net, key, record_validator())
    errors: list[str] = []
    try:
        def writer(i: int) -> None:
            for j in range(STORES):
                try:
                    ok = dht.store(f"k{i}", bytes([i]) * VALUE_BYTES, get_dht_time() + 60, subkey=f"s{j}",
                                   return_future=True).result(timeout=30)
                    assert ok
                except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                    errors.append(repr(exc)[:200])
                    return

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:3]
        assert dht.is_alive()
        for i in range(THREADS):
            found = dht.get(f"k{i}", latest=True)
            assert found is not None and len(found.value) == STORES
            assert all(v.value == bytes([i]) * VALUE_BYTES for v in found.value.values())
        for j in range(LARGE_STORES):
            assert dht.store("large", bytes([j]) * LARGE_BYTES, get_dht_time() + 60, subkey=f"s{j}",
                             return_future=True).result(timeout=30)
        found = dht.get("large", latest=True)
        assert found is not None and len(found.value) == LARGE_STORES and dht.is_alive()
    finally:
        dht.shutdown()
