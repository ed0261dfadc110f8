"""The in-process engine under a capped gather set: at most F contributions a round, the rest kept or dropped."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.data.streams import PreparedData
from hlbp.peer.model.decoder import preset
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.sim.engine import EngineConfig, make_full_replicas, run_outer_simulation

CPU = torch.device("cpu")


def _run(data: PreparedData, replicas: int, gather: int, keep: bool = True) -> dict:
    model = preset("tiny", vocab_size=data.vocab_size, max_seq_len=32)
    sim = EngineConfig(model=model, outer=OuterConfig(k=64), replicas=replicas, rounds=3, inner_steps=2,
                       batch_size=2, seq_len=32, eval_batches=2, gather=gather, keep_unselected=keep)
    return run_outer_simulation(sim, data, make_full_replicas(sim, data, CPU), CPU)


def test_a_cap_at_the_run_size_changes_nothing(builtin_data: PreparedData) -> None:
    with torch.random.fork_rng():
        whole, capped = _run(builtin_data, 3, 0), _run(builtin_data, 3, 3)
    assert capped["accepted_per_round"] == whole["accepted_per_round"] == 3
    assert [r["val_loss"] for r in capped["history"]] == [r["val_loss"] for r in whole["history"]]


def test_a_cap_accepts_f_and_keeping_the_rest_differs_from_dropping_it(builtin_data: PreparedData) -> None:
    with torch.random.fork_rng():
        kept, dropped = _run(builtin_data, 4, 2, keep=True), _run(builtin_data, 4, 2, keep=False)
    assert kept["accepted_per_round"] == dropped["accepted_per_round"] == 2
    # round 1 selects the same two either way; from round 2 the left-out replicas send what they kept
    assert kept["history"][1]["val_loss"] == dropped["history"][1]["val_loss"]
    assert kept["history"][-1]["val_loss"] != dropped["history"][-1]["val_loss"]


def test_a_capped_engine_does_not_overlap() -> None:
    with pytest.raises(ValueError, match="without overlap"):
        EngineConfig(model=preset("tiny", vocab_size=64, max_seq_len=32), outer=OuterConfig(), gather=2,
                     overlap="eager")
