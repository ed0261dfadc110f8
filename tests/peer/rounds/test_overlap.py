"""Where an overlapped inner phase starts, and what overlap does to a whole in-process run."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.data.streams import PreparedData
from hlbp.peer.model.decoder import preset
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.peer.rounds.overlap import phase_start, proxy_step
from hlbp.peer.sim.engine import SimConfig, make_full_replicas, run_outer_simulation
from hlbp.peer.train.trainer import OptimConfig
from hlbp.protocol.sparse import decompress


def _own(cfg: OuterConfig):
    g = torch.Generator().manual_seed(1)
    anchor = {"w": torch.randn(64, 64, generator=g), "n": torch.randn(64, generator=g)}
    local = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
    return anchor, make_outer(cfg).contribute(anchor, local, "me", 10)


def test_eager_start_is_the_late_global_moved_by_the_own_sent_contribution_at_its_expected_weight() -> None:
    cfg = OuterConfig(k=64, alpha=0.8)
    late, own = _own(cfg)
    start = phase_start("eager", cfg, late, own, 4)
    for n in late:
        assert torch.equal(start[n], late[n] - 0.8 / 4 * decompress(own.tensors[n]))
    for mode in ("none", "naive"):
        assert all(torch.equal(phase_start(mode, cfg, late, own, 4)[n], late[n]) for n in late)
    assert all(torch.equal(phase_start("eager", cfg, late, None, 4)[n], late[n]) for n in late)  # nothing sent
    assert late["w"].data_ptr() != start["w"].data_ptr()  # the global parameters are never touched
    # under the mean over selectors a coordinate's result is the mean of its selectors' values: own weight 1
    sel = OuterConfig(k=64, alpha=0.8, aggregation="selectors")
    assert torch.equal(proxy_step(sel, own, 4)["w"], 0.8 * decompress(own.tensors["w"]))
    dl = OuterConfig(kind="diloco", outer_lr=0.7, momentum=0.9)
    _, dense = _own(dl)
    assert torch.allclose(proxy_step(dl, dense, 2)["w"], 0.7 * 1.9 / 2 * dense.tensors["w"])
    with pytest.raises(ValueError):
        phase_start("late", cfg, late, own, 4)


def _run(data: PreparedData, overlap: str, replicas: int) -> dict:
    model = preset("tiny", vocab_size=data.vocab_size, max_seq_len=32)
    sim = SimConfig(model=model, outer=OuterConfig(k=64, aggregation="selectors"),
                    optim=OptimConfig(lr=3e-3, warmup_steps=2), replicas=replicas, rounds=3, inner_steps=2,
                    batch_size=2, seq_len=32, eval_batches=2, overlap=overlap)
    torch.set_num_threads(1)
    return run_outer_simulation(sim, data, make_full_replicas(sim, data, torch.device("cpu")), torch.device("cpu"))


def test_eager_with_one_replica_is_exactly_no_overlap_and_naive_is_not(builtin_data: PreparedData) -> None:
    """With R = 1 a round's result is the replica's own sent contribution, so eager's proxy is exact: the run must
    match the run without overlap value for value. Naive delay starts every phase one round behind and differs."""
    before = torch.get_num_threads()
    try:
        none, eager, naive = (_run(builtin_data, mode, 1) for mode in ("none", "eager", "naive"))
    finally:
        torch.set_num_threads(before)
    assert none["final_val_loss"] == eager["final_val_loss"]
    # between rounds eager's global parameters are one round late: exactly the no-overlap run's of the round before
    ev, nv = [r["val_loss"] for r in eager["history"]], [r["val_loss"] for r in none["history"]]
    assert ev[1:-1] == nv[:-2] and ev[-1] == nv[-1]
    assert naive["final_val_loss"] != none["final_val_loss"]
    assert naive["tokens"] == none["tokens"] == eager["tokens"]


def test_overlap_runs_end_on_every_rounds_contributions(builtin_data: PreparedData) -> None:
    """Under overlap the last exchange is applied after training: with R = 2 eager and naive end close to the run
    without overlap (same tokens), not one round short."""
    base = _run(builtin_data, "none", 2)
    for mode in ("eager", "naive"):
        res = _run(builtin_data, mode, 2)
        assert res["tokens"] == base["tokens"]
        assert abs(res["final_val_loss"] - base["final_val_loss"]) < 0.05 * base["final_val_loss"], mode
