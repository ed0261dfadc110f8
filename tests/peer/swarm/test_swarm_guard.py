"""The swarm's loss guard, on real hivemind P2P daemons on loopback: a driver (stage 0) and a last stage, each
holding a round's candidate parameters, score the run's guard batch end to end through the chain, and both learn
the same loss before either commits.

What must hold: the loss is the whole model's at the candidates (the dense fp32 codec loses nothing); the two sides
meet in either order (a guard that arrives before the stage's candidate waits for it); a poisoned stage-1 candidate
moves the loss past the guard's bounds (the round would be refused); a driver that ran no step of the round scores
nothing (its chain's stages do not wait for it long:
test_guardslot.py), and a guard the stage has passed is answered at once as unscored."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from stage_parts import CONFIG, dense_codec, stage_workers, started_dhts

from hlbp.peer.model.decoder import build_model, load_from_full
from hlbp.peer.model.pipeline import initial_state
from hlbp.peer.rounds import guard
from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.guardslot import GuardSlot
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.swarm.worker import StageWorker
from hlbp.peer.train.trainer import OptimConfig

ROUND = 3


@pytest.fixture
def chain() -> Iterator[tuple[Driver, StageServer, GuardSlot, list[StageWorker]]]:
    """A driver and a last stage that serves guards from its slot; the last stage has served one step of ROUND."""
    with started_dhts(2) as dhts:
        workers = stage_workers(OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10), 0, 1)
        members: set[str] = set()
        slot = GuardSlot()
        server = StageServer(dhts[1], workers[1], dense_codec(), CONFIG.vocab_size, lambda p: p in members, 4096,
                             slot=slot)
        driver = Driver(dhts[0], workers[0], dense_codec(), CONFIG.vocab_size, DriverConfig(micro_batches=2),
                        lambda: [[Candidate(server.peer_id, 100.0)]], 4096)
        members.add(driver.peer_id)
        try:
            x = torch.randint(0, CONFIG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
            driver.train_step(x[:, :-1], x[:, 1:], 0, 1e-3, round_r=ROUND)  # the stage serves round ROUND
            yield driver, server, slot, workers
        finally:
            driver.close()
            server.close()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(2))
    return x[:, :-1], x[:, 1:]


def _params(worker: StageWorker, factor: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() * factor for n, p in worker.stage.named_parameters()}


def _whole_model_loss(candidates: list[dict[str, torch.Tensor]], batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The whole model's loss on ``batch`` with the stages' candidates as its parameters (stages name their
    parameters as the whole model does)."""
    model = build_model(CONFIG)
    load_from_full(model, initial_state(CONFIG, 0))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for c in candidates:
            for n, t in c.items():
                params[n].copy_(t)
        x, y = batch
        logits = model(x)
        return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)))


def _score_on_stage(slot: GuardSlot, params: dict[str, torch.Tensor], delay_s: float, out: list) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        out.append(slot.score(ROUND, params, grace_s=30.0, timeout_s=30.0))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("stage_first", [True, False], ids=["stage-offers-first", "guard-arrives-first"])
def test_both_sides_learn_the_whole_models_loss_at_the_candidates(chain, stage_first: bool) -> None:
    driver, _server, slot, workers = chain
    batch = _batch()
    c0, c1 = _params(workers[0], 1.01), _params(workers[1], 0.99)  # candidates differ from the stages' weights
    on_stage: list = []
    # the stage holds its candidate before the guard comes, or the guard waits on the stage for its candidate
    thread = _score_on_stage(slot, c1, 0.0 if stage_first else 1.0, on_stage)
    if stage_first:
        time.sleep(0.5)
    got = driver.guard_loss(ROUND, c0, batch, timeout_s=30.0)
    thread.join(timeout=60)
    want = _whole_model_loss([c0, c1], batch)
    assert got is not None and on_stage == [got], (got, on_stage)
    assert abs(got - want) <= 1e-4 * want, (got, want)
    # the stages' own weights are not the candidates: the guard ran at the candidates and left the weights alone
    assert abs(got - _whole_model_loss([_params(workers[0]), _params(workers[1])], batch)) > 1e-3


def test_a_poisoned_candidate_moves_the_loss_past_the_guard(chain) -> None:
    driver, _server, slot, workers = chain
    batch = _batch()
    c0 = _params(workers[0])
    honest_out: list = []
    thread = _score_on_stage(slot, _params(workers[1]), 0.0, honest_out)
    honest = driver.guard_loss(ROUND, c0, batch, timeout_s=30.0)
    thread.join(timeout=60)
    assert honest is not None and guard.loss_reason([honest], honest, guard.GuardConfig()) is None
    # a stage-1 shard moved by a sign-flipped contribution far past the others: the next round's candidate
    poisoned = {n: -40.0 * t for n, t in _params(workers[1]).items()}
    out: list = []
    thread = _score_on_stage(slot, poisoned, 0.0, out)
    # the stage holds it before the guard is sent: a guard of a round whose candidate the stage has already scored
    # and let go is answered at once as unscored (a loaded box can start the thread after the guard arrives)
    poll(lambda: slot.params(ROUND) is poisoned, 30.0, "the poisoned candidate held on the stage")
    loss = driver.guard_loss(ROUND, c0, batch, timeout_s=30.0)
    thread.join(timeout=60)
    print(f"guard loss: honest candidate {honest:.4f}, poisoned {loss:.4f}")
    assert loss is not None and out == [loss]
    assert guard.loss_reason([honest], loss, guard.GuardConfig()) is not None


def test_a_round_the_driver_did_not_step_is_not_scored_and_a_passed_one_is_answered_at_once(chain) -> None:
    driver, _server, slot, workers = chain
    batch = _batch()
    out: list = []
    _score_on_stage(slot, _params(workers[1]), 0.0, out)
    assert driver.guard_loss(ROUND, _params(workers[0]), batch, 30.0) is not None
    _until_one(out)
    start = time.monotonic()
    assert driver.guard_loss(ROUND + 1, _params(workers[0]), batch, 30.0) is None  # no step of that round
    # the stage has passed round ROUND's guard: it answers at once that it holds no candidate
    assert driver.guard_loss(ROUND, _params(workers[0]), batch, 30.0) is None
    assert time.monotonic() - start < 5.0


def _until_one(out: list) -> None:
    deadline = time.monotonic() + 30
    while not out:
        assert time.monotonic() < deadline
        time.sleep(0.05)
