"""A last stage that lies about the step it finished: on real hivemind P2P daemons on loopback, a driver (stage 0)
with two candidates for the last stage, one of which sends every ``done`` with a learning rate of 10 (the attack seen
live: it applied that rate itself and told stage 0 to do the same).

What must hold: stage 0 refuses the ``done`` (``done_fault``), bans its sender and runs the step on the honest peer,
so the swarm's losses are exactly those of a swarm that never met the liar, and stage 0's parameters too.

The liar is a real :class:`StageServer` with one change made from here: it rewrites the rate of every finish it
receives before finishing (so the step it applies and the ``done`` it sends agree with each other, not with the
driver)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import hivemind
import pytest
import torch
from stage_parts import CONFIG, dense_codec, stage_workers, started_dhts

from hlbp.peer.swarm.driver import Driver, DriverConfig, StepAbandoned
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.stagewire import StageMessage

STEPS = 4
LR = 1e-3


class LyingServer(StageServer):
    """A last stage that finishes every step at a learning rate of 10, whatever the driver asked for."""

    def _finish(self, msg: StageMessage) -> None:
        super()._finish(replace(msg, lr=10.0))


@pytest.fixture
def dhts() -> Iterator[list[hivemind.DHT]]:
    with started_dhts(5) as nodes:
        yield nodes


def _train(dhts: list[hivemind.DHT], with_liar: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    """STEPS steps of a 2-stage swarm on the same batch, on DHTs of its own (driver, honest last stage, liar); the
    liar, when there, is the driver's first choice."""
    optim = OptimConfig(lr=LR, warmup_steps=1, total_steps=10)
    workers = stage_workers(optim, 0, 1, 1)  # the driver's stage 0, the honest last stage, the liar's
    members: set[str] = set()
    honest = StageServer(dhts[1], workers[1], dense_codec(), CONFIG.vocab_size, lambda p: p in members, 4096)
    liar = LyingServer(dhts[2], workers[2], dense_codec(), CONFIG.vocab_size, lambda p: p in members, 4096) \
        if with_liar else None
    # the liar announces a far higher throughput, so the driver tries it first
    candidates = [Candidate(honest.peer_id, 100.0)] + ([Candidate(liar.peer_id, 1e6)] if liar else [])
    driver = Driver(dhts[0], workers[0], dense_codec(), CONFIG.vocab_size, DriverConfig(micro_batches=2),
                    lambda: [candidates], 4096)
    members.add(driver.peer_id)
    counts: dict[str, int] = {}
    try:
        torch.manual_seed(5)
        x = torch.randint(0, CONFIG.vocab_size, (4, 9))
        losses = [driver.train_step(x[:, :-1], x[:, 1:], step, lr_at(step, optim)).loss for step in range(STEPS)]
        if liar is not None:
            counts = {"liar_applied": liar.counters.steps_applied, "honest_applied": honest.counters.steps_applied,
                      "banned": int(driver.chains.bans.banned(liar.peer_id, time.monotonic()))}
        return losses, {n: p.detach().clone() for n, p in workers[0].parameters().items()}, counts
    finally:
        driver.close()
        honest.close()
        if liar is not None:
            liar.close()


def test_a_done_at_another_rate_is_refused_its_sender_banned_and_the_step_rerun(dhts: list[hivemind.DHT]) -> None:
    clean_losses, clean_params, _ = _train(dhts[:2], with_liar=False)
    losses, params, counts = _train(dhts[2:], with_liar=True)
    print(f"losses with the liar {[round(v, 4) for v in losses]}, without {[round(v, 4) for v in clean_losses]}")
    assert counts["banned"] == 1 and counts["liar_applied"] >= 1  # it stepped at its own rate, alone
    assert counts["honest_applied"] == STEPS
    assert losses == clean_losses  # the refused step was run again on the honest peer, from the same state
    assert all(torch.equal(params[n], clean_params[n]) for n in clean_params)
    assert losses[-1] < losses[0]


def test_a_driver_that_names_another_rate_steps_no_stage(dhts: list[hivemind.DHT]) -> None:
    """The other end of the chain lies: a driver (stage 0) that tells its chain to step at a rate of 10. Every
    stage derives the rate from the run's schedule, so the finish is refused, nothing is applied, and the driver is
    banned by the stage."""
    optim = OptimConfig(lr=LR, warmup_steps=1, total_steps=10)
    workers = stage_workers(optim, 0, 1)
    codecs = [dense_codec(), dense_codec()]
    members: set[str] = set()
    server = StageServer(dhts[1], workers[1], codecs[1], CONFIG.vocab_size, lambda p: p in members, 4096)
    driver = Driver(dhts[0], workers[0], codecs[0], CONFIG.vocab_size, DriverConfig(micro_batches=2),
                    lambda: [[Candidate(server.peer_id, 100.0)]], 4096)
    members.add(driver.peer_id)
    before = {n: p.detach().clone() for n, p in workers[1].parameters().items()}
    try:
        x = torch.randint(0, CONFIG.vocab_size, (4, 9))
        with pytest.raises(StepAbandoned):
            driver.train_step(x[:, :-1], x[:, 1:], 0, 10.0, give_up=lambda: True)
        assert server.bans.banned(driver.peer_id, time.monotonic())
        assert server.counters.steps_applied == 0
        assert all(torch.equal(p, before[n]) for n, p in workers[1].parameters().items())
    finally:
        driver.close()
        server.close()
