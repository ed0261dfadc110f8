"""Fixtures of the round-protocol tests."""

from __future__ import annotations

from typing import Any

import pytest
from attack_runs import checked_rounds, start


@pytest.fixture(scope="session")
def honest_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The all-honest twin of the attack runs (attack_runs.py), its records by round: the fourth peer runs as an
    honest replica under the attacker's identity."""
    with start(tmp_path_factory.mktemp("all-honest")) as sw:
        return checked_rounds(sw)


@pytest.fixture(scope="session")
def three_honest_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The three honest replicas of the attack runs alone, their records by round: what a run whose attacker is left
    out compares with."""
    with start(tmp_path_factory.mktemp("three-honest"), fourth=False) as sw:
        return checked_rounds(sw)
