"""Fixtures of the round-protocol tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from attack_runs import checked_rounds, start

from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.state import ReplicaState
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig


@pytest.fixture
def tiny_replica() -> tuple[InnerTrainer, Callable[[], ReplicaState]]:
    """A tiny model's trainer and a maker of round states anchored at its parameters: what a checkpoint saves and a
    resume fills, without a round loop."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", max_seq_len=16))
    trainer = InnerTrainer(model, OptimConfig(lr=1e-3, warmup_steps=0, total_steps=10),
                           lambda step, micro: (torch.zeros(1, 16, dtype=torch.long),) * 2, torch.device("cpu"))

    def state() -> ReplicaState:
        return ReplicaState({n: p.detach().clone() for n, p in model.named_parameters()},
                            {0: make_outer(OuterConfig())})

    return trainer, state


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
