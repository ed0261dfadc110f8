"""Fixtures shared by the peer tests: the built-in corpus, downloaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hlbp.peer.data.corpus import builtin_documents


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One download per test session: into $HLBP_CACHE if the user set it, else a fresh temporary folder.

    A fresh folder (not the user's ~/.cache) is the default so that the real fetch-verify-extract path runs.
    """
    cache = (
        Path(os.environ["HLBP_CACHE"]) if os.environ.get("HLBP_CACHE") else tmp_path_factory.mktemp("hlbp")
    )
    builtin_documents(cache)
    return cache
