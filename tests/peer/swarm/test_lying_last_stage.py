"""Stage peers that lie about the step they finished, on real hivemind P2P daemons on loopback.

A step ends with the driver's ``apply`` (the norms come up with the backward); a last stage that withholds its norm
makes the driver ask for it with a ``finish``, and then its ``done`` carries the step's rate back up. The attack
seen live: a last stage that applied a learning rate of 10 itself and told stage 0 to do the same. What must hold:
stage 0 refuses the ``done`` (``done_fault``), bans its sender and runs the step on the honest peer, so the swarm's
losses are exactly those of a swarm that never met the liar, and stage 0's parameters too. A ``done`` nobody asked
for (sent up before any finish) is refused by the stage above, whose weights stay those of a clean swarm. A driver
that names another rate in its ``apply`` steps no stage.

The liars are real :class:`StageServer` objects with one change made from here each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import hivemind
import pytest
import torch
from stage_parts import CONFIG, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.links import Conn
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.swarm.worker import clip_scale
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.stagewire import StageMessage

STEPS = 4
LR = 1e-3


class LyingServer(StageServer):
    """A last stage that never sends its norm up with its backward, so the driver asks with a finish, and that
    finishes every step at a learning rate of 10, whatever the driver asked for."""

    def _norms(self, msg: StageMessage, below: float | None) -> tuple[float, int]:
        return 0.0, 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        honest = self.ends.finish  # its step's end is wrapped: every finish it runs says a rate of 10

        def finish(conn: Conn, msg: StageMessage) -> None:
            honest(conn, replace(msg, lr=10.0))

        self.ends.finish = finish  # type: ignore[method-assign]


class UnaskedDoneServer(StageServer):
    """A last stage that, with the backward completing each step, sends up a ``done`` at a rate of 10 whose norm
    and clipping factor agree with each other, before any finish could reach it."""

    def _norms(self, msg: StageMessage, below: float | None) -> tuple[float, int]:
        total, count = super()._norms(msg, below)
        if count:
            self._send_up(StageMessage("done", session=msg.session, step=msg.step, lr=10.0, sumsq=total,
                                       scale=clip_scale(total, 1.0), tokens=1))
        return total, count


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
        counts = {"round_trips": driver.counters.norm_round_trips}
        if liar is not None:
            # the last step's apply reaches the stage after the driver has moved on
            poll(lambda: honest.counters.steps_applied >= STEPS, 30, "the honest stage to apply the last step")
            counts |= {"liar_applied": liar.counters.steps_applied, "honest_applied": honest.counters.steps_applied,
                       "banned": int(driver.chains.bans.banned(liar.peer_id, time.monotonic()))}
        return losses, {n: p.detach().clone() for n, p in workers[0].parameters().items()}, counts
    finally:
        driver.close()
        honest.close()
        if liar is not None:
            liar.close()


def test_a_done_at_another_rate_is_refused_its_sender_banned_and_the_step_rerun(dhts: list[hivemind.DHT]) -> None:
    clean_losses, clean_params, clean = _train(dhts[:2], with_liar=False)
    losses, params, counts = _train(dhts[2:], with_liar=True)
    print(f"losses with the liar {[round(v, 4) for v in losses]}, without {[round(v, 4) for v in clean_losses]}")
    assert clean["round_trips"] == 0  # an honest chain's norms come up with the backward: no finish asked for
    assert counts["banned"] == 1 and counts["liar_applied"] >= 1  # it stepped at its own rate, alone
    assert counts["round_trips"] == 0  # its done was refused, not counted; the honest peer ran every step
    assert counts["honest_applied"] == STEPS
    assert losses == clean_losses  # the refused step was run again on the honest peer, from the same state
    assert all(torch.equal(params[n], clean_params[n]) for n in clean_params)
    assert losses[-1] < losses[0]


def test_a_driver_that_names_another_rate_steps_no_stage(dhts: list[hivemind.DHT]) -> None:
    """The other end of the chain lies: a driver (stage 0) that tells its chain to step at a rate of 10. Every
    stage derives the rate from the run's schedule, so the apply is refused, nothing is applied, and the driver is
    banned by the stage (its own stage 0 stepped as it chose: its own business)."""
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
        driver.train_step(x[:, :-1], x[:, 1:], 0, 10.0, give_up=lambda: True)
        poll(lambda: server.counters.steps_skipped == 1, 30, "the stage to drop the step it was told to apply")
        assert server.bans.banned(driver.peer_id, time.monotonic())
        assert server.counters.steps_applied == 0
        assert all(torch.equal(p, before[n]) for n, p in workers[1].parameters().items())
    finally:
        driver.close()
        server.close()


@pytest.fixture
def dhts7() -> Iterator[list[hivemind.DHT]]:
    with started_dhts(7) as nodes:
        yield nodes


def _train3(dhts: list[hivemind.DHT], liar_cls: type[StageServer] | None) -> tuple[list[float], dict[str, torch.Tensor],
                                                                                  dict[str, int]]:
    """STEPS steps of a 3-stage swarm on the same batch (driver, middle stage, honest last stage, and the liar of
    class ``liar_cls`` as the driver's first choice for the last stage); the losses, the middle stage's parameters
    and what happened."""
    optim = OptimConfig(lr=LR, warmup_steps=1, total_steps=10)
    workers = stage_workers(optim, 0, 1, 2, 2, n_stages=3)
    members: set[str] = set()

    def server(k: int, cls: type[StageServer] = StageServer) -> StageServer:
        return cls(dhts[k], workers[k], dense_codec(), CONFIG.vocab_size, lambda p: p in members, 4096)

    middle, honest = server(1), server(2)
    liar = server(3, liar_cls) if liar_cls is not None else None
    last = [Candidate(honest.peer_id, 100.0)] + ([Candidate(liar.peer_id, 1e6)] if liar else [])
    driver = Driver(dhts[0], workers[0], dense_codec(), CONFIG.vocab_size, DriverConfig(micro_batches=2),
                    lambda: [[Candidate(middle.peer_id, 100.0)], last], 4096)
    members.update({driver.peer_id, middle.peer_id})
    try:
        torch.manual_seed(5)
        x = torch.randint(0, CONFIG.vocab_size, (4, 9))
        losses = [driver.train_step(x[:, :-1], x[:, 1:], step, lr_at(step, optim)).loss for step in range(STEPS)]
        # the last step's apply reaches the stages after the driver has moved on
        poll(lambda: middle.counters.steps_applied >= STEPS and honest.counters.steps_applied >= STEPS, 30,
             "the middle and the honest last stage to apply every step")
        counts = {"middle_applied": middle.counters.steps_applied, "honest_applied": honest.counters.steps_applied}
        if liar is not None:
            counts |= {"banned_by_middle": int(middle.bans.banned(liar.peer_id, time.monotonic())),
                       "banned_by_driver": int(driver.chains.bans.banned(liar.peer_id, time.monotonic()))}
        return losses, {n: p.detach().clone() for n, p in workers[1].parameters().items()}, counts
    finally:
        driver.close()
        for s in (middle, honest, liar):
            if s is not None:
                s.close()


def test_a_done_nobody_asked_for_is_refused_by_the_stage_above(dhts7: list[hivemind.DHT]) -> None:
    clean_losses, clean_params, clean = _train3(dhts7[:3], None)
    losses, params, counts = _train3(dhts7[3:], UnaskedDoneServer)
    print(f"losses with the liar {[round(v, 4) for v in losses]}, without {[round(v, 4) for v in clean_losses]}")
    assert clean["middle_applied"] == STEPS
    assert counts["banned_by_middle"] == 1 and counts["banned_by_driver"] == 1
    assert counts["middle_applied"] == STEPS and counts["honest_applied"] == STEPS
    assert losses == clean_losses  # the step was run again on the honest peer, from the same state
    assert all(torch.equal(params[n], clean_params[n]) for n in clean_params)  # never stepped at the liar's rate
