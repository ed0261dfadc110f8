"""Shared fixtures: the real built-in corpus (fetched once into the user cache) and a small real-text file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlbp.peer.data.streams import PreparedData, builtin_documents, default_cache_dir, prepare_data


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
