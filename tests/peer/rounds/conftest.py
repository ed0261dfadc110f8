"""Fixtures of the round-protocol tests."""

from __future__ import annotations

import pytest
from attack_runs import final_losses, start


@pytest.fixture(scope="session")
def honest_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The all-honest twin of the attack runs (attack_runs.py): each honest replica's final validation loss, with
    the fourth peer running as an honest replica under the attacker's identity."""
    with start(tmp_path_factory.mktemp("all-honest")) as sw:
        return final_losses(sw)


@pytest.fixture(scope="session")
def three_honest_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The three honest replicas of the attack runs alone: what a run whose attacker is left out compares with."""
    with start(tmp_path_factory.mktemp("three-honest"), fourth=False) as sw:
        return final_losses(sw)
