"""A listen port already taken is one clear error before any daemon starts, from the function and from the CLI."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.net.control import check_ports_free


@pytest.fixture
def busy_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_taken_port_is_named(busy_port: int) -> None:
    with pytest.raises(UserInputError, match=f"TCP port {busy_port} on 127.0.0.1 is already in use"):
        check_ports_free([f"/ip4/127.0.0.1/tcp/{busy_port}"])


def test_free_any_and_non_tcp_addresses_pass(busy_port: int) -> None:
    check_ports_free(["/ip4/127.0.0.1/tcp/0", f"/ip4/127.0.0.1/udp/{busy_port}/quic", "/dns4/example/tcp/1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_ports_free([f"/ip4/127.0.0.1/tcp/{free}"])  # released again: free


def test_bootstrap_on_a_taken_port_exits_2_with_one_line(busy_port: int, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "hlbp.cli.main", "bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{busy_port}",
         "--identity", str(tmp_path / "id.key"), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"TCP port {busy_port} on 127.0.0.1 is already in use" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "cache").exists()  # found before the tokenizer was built (tens of seconds in a fresh cache)
