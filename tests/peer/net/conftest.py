"""Fixtures for the control-plane tests: processes reaped at teardown, in-process DHT observers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from control_helpers import LOOPBACK, Proc


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Proc]]:
    """Start control-plane commands; every one still alive at the end of the module is reaped."""
    procs: list[Proc] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HLBP_CACHE": str(tmp_path_factory.mktemp("cache"))}

    def start(*args: str) -> Proc:
        proc = Proc(list(args), env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.popen.poll() is None:
            try:
                proc.terminate(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        proc.kill_all()  # also reaps a DHT process or p2pd left behind by a clean exit


@pytest.fixture(scope="module")
def observer_factory() -> Iterator[Callable[[str], Any]]:
    """In-process DHT clients (hivemind's DHT in a child process), shut down after the test."""
    from hlbp.peer.net.control import ControlPlane, NetworkConfig

    planes: list[Any] = []
    dirs: list[Any] = []

    def make(maddr: str) -> Any:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="hlbp-observer-")
        dirs.append(tmp)
        net = NetworkConfig(initial_peers=[maddr], host_maddrs=[LOOPBACK], client_mode=True, connect_timeout_s=20)
        plane = ControlPlane.connect(net, Path(tmp.name) / "id.key")
        planes.append(plane)
        return plane

    yield make
    for plane in planes:
        plane.shutdown()
    for tmp in dirs:
        tmp.cleanup()
