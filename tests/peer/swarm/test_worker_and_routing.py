"""The pure parts of pipeline swarms: a chain of stage workers in one process, bans, deadlines and chain choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hlbp.peer.model.decoder import build_model, load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.swarm.routing import Bans, Candidate, LatencyTracker, choose_chain
from hlbp.peer.swarm.worker import StageStateError, StageWorker, clip_scale
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, lr_at

CONFIG = preset("tiny", vocab_size=300, n_layers=3)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=20)


def _workers() -> list[StageWorker]:
    full = initial_state(CONFIG, 0)
    stages = split(CONFIG, 3)
    for s in stages:
        load_from_full(s, full)
    return [StageWorker(s, OPTIM, torch.device("cpu")) for s in stages]


def _run_mb(workers: list[StageWorker], mb: int, attempt: int, x: torch.Tensor, y: torch.Tensor,
            weight: float) -> None:
    h = workers[0].forward(mb, attempt, x)
    h = workers[1].forward(mb, attempt, h)
    _, g = workers[2].loss_backward(mb, attempt, h, y, weight)
    g = workers[1].backward(mb, attempt, g)
    workers[0].backward(mb, attempt, g)


def _step(workers: list[StageWorker], step: int, x: torch.Tensor, y: torch.Tensor, rerun: tuple[int, ...] = ()) -> None:
    for w in workers:
        w.begin(1, step)
    chunks = list(zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
    for mb, (a, b) in enumerate(chunks):
        _run_mb(workers, mb, 0, a, b, 0.5)
    for mb in rerun:  # a retry through the same stages must not count twice
        _run_mb(workers, mb, 1, *chunks[mb], 0.5)
    scale = clip_scale(sum(w.sumsq() for w in workers), OPTIM.grad_clip)
    for w in workers:
        assert w.apply(lr_at(step, OPTIM), scale)


@pytest.mark.parametrize("rerun", [(), (0, 1)])
def test_a_chain_of_workers_equals_the_whole_model_and_retries_count_once(rerun: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 300, (4, 17), generator=g) for _ in range(4)]
    workers = _workers()
    for step, b in enumerate(batches):
        _step(workers, step, b[:, :-1], b[:, 1:], rerun)
    model = build_model(CONFIG)
    model.load_state_dict(initial_state(CONFIG, 0))
    trainer = InnerTrainer(model, dataclasses.replace(OPTIM, grad_accum=2),
                           lambda s, m: (batches[s][2 * m:2 * m + 2, :-1], batches[s][2 * m:2 * m + 2, 1:]),
                           torch.device("cpu"))
    for _ in batches:
        trainer.train_step()
    want = dict(model.named_parameters())
    for w in workers:
        for name, p in w.parameters().items():
            torch.testing.assert_close(p, want[name], atol=1e-5, rtol=1e-4)


def test_backward_of_an_unknown_or_superseded_attempt_is_a_state_error() -> None:
    workers = _workers()
    workers[1].begin(1, 0)
    h = torch.randn(1, 4, CONFIG.d_model)
    workers[1].forward(0, 0, h)
    workers[1].forward(0, 1, h)  # a retry replaces the stored attempt
    with pytest.raises(StageStateError):
        workers[1].backward(0, 0, torch.ones(1, 4, CONFIG.d_model))
    with pytest.raises(StageStateError):
        workers[1].backward(5, 0, torch.ones(1, 4, CONFIG.d_model))
    workers[1].begin(2, 0)  # a new session drops what the old one stored
    assert not workers[1].saved


def test_stored_micro_batches_are_bounded() -> None:
    w = _workers()[1]
    w.max_stored = 3
    w.begin(1, 0)
    for mb in range(5):
        w.forward(mb, 0, torch.randn(1, 2, CONFIG.d_model))
    assert list(w.saved) == [2, 3, 4] and w.dropped == 2


def test_forgotten_moments_step_like_a_fresh_adamw() -> None:
    """After a phase whose gradients came through a liar, the stage forgets AdamW's state: its next step is the one
    a fresh optimizer takes from the same weights and gradient."""
    w, fresh = _workers()[1], _workers()[1]
    x, g = torch.randn(1, 2, CONFIG.d_model), torch.randn(1, 2, CONFIG.d_model)
    for step in range(3):  # moments learned from gradients x1000
        w.begin(1, step)
        w.forward(0, 0, x)
        w.backward(0, 0, g * 1000)
        assert w.apply(1e-3, 1.0)
    assert w.optimizer.state
    w.forget_moments()
    assert not w.optimizer.state
    with torch.no_grad():
        for n, p in fresh.parameters().items():
            p.copy_(w.parameters()[n])
    for worker in (w, fresh):
        worker.begin(2, 0)
        worker.forward(0, 0, x)
        worker.backward(0, 0, g)
        assert worker.apply(1e-3, 1.0)
    assert all(torch.equal(p, fresh.parameters()[n]) for n, p in w.parameters().items())


def test_a_non_finite_gradient_steps_nothing() -> None:
    w = _workers()[1]
    before = {n: p.detach().clone() for n, p in w.parameters().items()}
    w.begin(1, 0)
    out = w.forward(0, 0, torch.randn(1, 2, CONFIG.d_model))
    w.backward(0, 0, torch.full_like(out, float("nan")))
    assert not w.apply(1e-3, 1.0)
    assert all(torch.equal(p, before[n]) for n, p in w.parameters().items())


def test_clip_scale_matches_torch() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.arange(10.0)
    norm = float(p.grad.pow(2).sum())
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert clip_scale(norm, 1.0) * 9 == pytest.approx(float(p.grad[9]), rel=1e-6)
    assert clip_scale(0.25, 1.0) == 1.0 and clip_scale(4.0, 0.0) == 1.0


def test_bans_back_off_exponentially_and_are_forgiven() -> None:
    bans = Bans(base_s=5, max_s=30)
    assert bans.fail("a", 0) == 5 and bans.fail("a", 0) == 10 and bans.fail("a", 0) == 20 and bans.fail("a", 0) == 30
    assert bans.banned("a", 29) and not bans.banned("a", 31)
    bans.ok("a")
    assert bans.fail("a", 100) == 5


def test_deadline_is_three_p95_within_bounds_or_the_override() -> None:
    lat = LatencyTracker(min_s=1, max_s=10)
    assert lat.deadline() == 10  # nothing measured yet
    for s in [0.1] * 19 + [0.2]:
        lat.add(s)
    assert lat.deadline() == 1  # 3 x 0.2 is below the floor
    for s in [2.0] * 20:
        lat.add(s)
    assert lat.deadline() == 6
    assert LatencyTracker(override_s=42).deadline() == 42


def test_chain_is_sticky_and_otherwise_least_expected_finish_time() -> None:
    bans = Bans()
    stage = [Candidate("slow", 100.0), Candidate("fast", 1000.0), Candidate("busy", 1000.0, queued_tokens=10_000)]
    assert choose_chain([stage], [None], bans, 0, 100) == ["fast"]
    assert choose_chain([stage], ["slow"], bans, 0, 100) == ["slow"]  # no switch without a failure
    bans.fail("slow", 0)
    assert choose_chain([stage], ["slow"], bans, 1, 100) == ["fast"]
    assert choose_chain([stage, []], [None, None], bans, 1, 100) is None  # a stage nobody serves


def test_at_a_phase_start_a_stage_goes_to_a_peer_at_least_switch_factor_times_faster() -> None:
    bans = Bans()
    stage = [Candidate("slow", 100.0), Candidate("fast", 250.0)]
    assert choose_chain([stage], ["slow"], bans, 0, 100, switch_factor=2.0) == ["fast"]
    assert choose_chain([stage], ["slow"], bans, 0, 100, switch_factor=3.0) == ["slow"]  # not fast enough for it
    assert choose_chain([stage], ["slow"], bans, 0, 100) == ["slow"]  # mid-phase: never
    # the fastest takes it, and only the stages with such a peer change
    other = [Candidate("mid", 1000.0), Candidate("peer", 1500.0)]
    three = stage + [Candidate("fastest", 400.0)]
    assert choose_chain([three, other], ["slow", "mid"], bans, 0, 100, switch_factor=2.0) == ["fastest", "mid"]
    # equal speeds never switch, whatever the factor; a banned faster peer is not taken
    assert choose_chain([[Candidate("a", 5.0), Candidate("b", 5.0)]], ["b"], bans, 0, 100, switch_factor=1.01) == ["b"]
    bans.fail("fast", 0)
    assert choose_chain([stage], ["slow"], bans, 1, 100, switch_factor=2.0) == ["slow"]


def test_a_done_that_does_not_add_up_is_refused() -> None:
    from hlbp.peer.swarm.worker import clip_scale, done_fault

    total = 4.0 + 5.0  # this stage counted 4.0; the last stage added its own 5.0
    honest = clip_scale(total, 1.0)
    assert done_fault(1e-3, honest, total, 1e-3, 1.0, 4.0) is None
    assert "learning rate 10" in done_fault(10.0, honest, total, 1e-3, 1.0, 4.0)  # the attack seen live
    assert "learning rate 0.03" in done_fault(0.03, honest, total, 1e-3, 1.0, 4.0)
    assert "below the 4 counted here" in done_fault(1e-3, clip_scale(1.0, 1.0), 1.0, 1e-3, 1.0, 4.0)
    assert "clipping scale 1" in done_fault(1e-3, 1.0, total, 1e-3, 1.0, 4.0)  # a scale of 1 undoes the clipping
    assert done_fault(1e-3, 1.0, total, 1e-3, 0.0, 4.0) is None  # no clipping in the run: scale 1 is right
    assert done_fault(1e-3, 0.0, 1e300, 1e-3, 1.0, 4.0) is None  # a non-finite step: skipped everywhere


def test_a_finish_off_the_schedule_is_refused() -> None:
    from hlbp.peer.swarm.worker import finish_fault
    from hlbp.peer.train.trainer import OptimConfig, lr_at

    optim = OptimConfig(lr=1e-3, warmup_steps=2, total_steps=10)
    for step in (0, 1, 2, 7, 10, 50):
        assert finish_fault(lr_at(step, optim), step, optim.grad_clip, optim) is None
    assert "learning rate 10" in finish_fault(10.0, 3, optim.grad_clip, optim)  # the rate the attack chose
    assert "learning rate" in finish_fault(lr_at(3, optim), 4, optim.grad_clip, optim)  # another step's rate
    assert "clipping norm 1e+06" in finish_fault(lr_at(3, optim), 3, 1e6, optim)  # clipping undone
    assert "optimizer step -1" in finish_fault(lr_at(0, optim), -1, optim.grad_clip, optim)
