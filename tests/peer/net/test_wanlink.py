"""The user-space WAN emulator: a round trip through a proxy takes 2 x delay, and a bulk transfer its rate."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from hlbp.peer.net.wanlink import PRIVATE_LOW, Link, WanEmulator, free_port


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _recv_exactly(sock: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        chunk = sock.recv(min(1 << 20, n - got))
        assert chunk, "connection closed early"
        got += len(chunk)
    return got


def test_link_schedule_serializes_bytes() -> None:
    link = Link(rate=1000.0)
    assert link.schedule(0.0, 500) == 0.5
    assert link.schedule(0.1, 500) == 1.0  # queued behind the first 500 bytes
    assert link.schedule(5.0, 100) == 5.1  # an idle link starts now
    assert Link(rate=None).schedule(3.0, 10**9) == 3.0


def test_round_trip_and_rate_through_the_proxy() -> None:
    srv, port = _echo_server()
    with WanEmulator(delay_s=0.05, rate_mbps=40.0) as wan:  # 5 MB/s each way
        proxy = wan.add(port)
        with socket.create_connection(("127.0.0.1", proxy), timeout=10) as c:
            rtts = []
            for _ in range(3):
                t0 = time.perf_counter()
                c.sendall(b"z")
                _recv_exactly(c, 1)
                rtts.append(time.perf_counter() - t0)
            assert min(rtts) >= 0.095, rtts  # out and back, 50 ms each way
            payload = bytes(2_000_000)
            t0 = time.perf_counter()
            threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
            _recv_exactly(c, len(payload))
            elapsed = time.perf_counter() - t0
        assert 0.35 <= elapsed <= 3.0, elapsed  # 2 MB at 5 MB/s each way is at least 0.4 s, plus delays
        stats = wan.stats()[proxy]
        assert stats.connections == 1 and stats.inbound >= len(payload) and stats.outbound >= len(payload)
    srv.close()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        WanEmulator(delay_s=-1.0, rate_mbps=None)


def test_a_free_port_is_below_the_ephemeral_range_and_free() -> None:
    # outgoing connections take their source ports from the ephemeral range: a port handed out there can be taken
    # before the process it was meant for binds it
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(PRIVATE_LOW <= p < low for p in ports), ports
    with socket.socket() as held:
        held.bind(("127.0.0.1", min(ports)))
        held.listen()
        assert all(free_port() != min(ports) for _ in range(50))  # one that is taken is never handed out
