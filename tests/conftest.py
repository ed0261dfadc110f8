"""Shared fixtures: the real built-in corpus (fetched once into the user cache), a small real-text file, and a
small disk."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hlbp.peer.data.streams import PreparedData, builtin_documents, default_cache_dir, prepare_data
from hlbp.peer.net.dht import P2PD_ENV

# the daemons tests start with hivemind's own DHT or P2P run as hlbp's peers' do (test_simultaneous_dial says why)
os.environ.update(P2PD_ENV)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The shared cache: the corpus is verified by checksum on every load, so reuse across runs is safe."""
    return default_cache_dir()


@pytest.fixture(scope="session")
def builtin_data(cache_dir: Path) -> PreparedData:
    """The built-in corpus with its default 8k tokenizer, as `hlbp train` uses it."""
    return prepare_data("builtin", cache_dir)


@pytest.fixture(scope="session")
def small_text(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """About 300 KB of real prose (Shakespeare and Wikipedia leads) in one plain-text file."""
    docs = builtin_documents(cache_dir)
    picked = docs[:3] + docs[-200:]
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text("\n\n".join(d.text for d in picked)[:300_000], encoding="utf-8")
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system of its own: a tmpfs mounted for this test and unmounted after it (root is needed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
