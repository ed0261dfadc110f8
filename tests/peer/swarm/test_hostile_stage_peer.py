"""A stage server under attack, on real hivemind P2P daemons on loopback: frames from a peer outside the swarm are
refused at the stream, a member's malformed frame bans it and is never applied, and the swarm trains on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import hivemind
import pytest
import torch
from stage_parts import CONFIG, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.driver import Driver, DriverConfig
from hlbp.peer.swarm.links import StageLinks
from hlbp.peer.swarm.routing import Candidate
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.activations import encode_activations
from hlbp.protocol.stagewire import StageMessage, encode_message, encode_tokens


@pytest.fixture
def dhts() -> Iterator[list[hivemind.DHT]]:
    with started_dhts(3) as nodes:
        yield nodes


def test_bad_frames_ban_their_sender_and_change_nothing(dhts: list[hivemind.DHT]) -> None:
    optim = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)
    workers = stage_workers(optim, 0, 1)
    codecs = [dense_codec(), dense_codec()]
    members: set[str] = set()
    server = StageServer(dhts[1], workers[1], codecs[1], CONFIG.vocab_size, lambda p: p in members, 4096)
    driver = Driver(dhts[0], workers[0], codecs[0], CONFIG.vocab_size, DriverConfig(micro_batches=2),
                    lambda: [[Candidate(server.peer_id, 100.0)]], 4096)
    members.add(driver.peer_id)
    rogue = StageLinks(dhts[2], lambda *a: None, lambda c: None, lambda p, e: None, lambda p: False, 1 << 20)
    try:
        before = {n: p.detach().clone() for n, p in workers[1].parameters().items()}
        good = encode_activations(torch.randn(1, 4, CONFIG.d_model), "forward", "fp32") + \
            encode_tokens(torch.zeros(1, 4), torch.zeros(1, 4), CONFIG.vocab_size)
        fwd = StageMessage("fwd", session=9, step=1, weight=1.0)

        # 1. not a member of the swarm: the stream is refused, nothing is computed
        rogue.dial(server.peer_id).send(encode_message(fwd, good))
        poll(lambda: not any(c.peer == server.peer_id for c in rogue.conns.values()), 20, "the refused stream to close")
        assert server.counters.forwards == 0
        members.add(rogue.peer_id)  # 2. now a member, but it lies
        wrong_width = encode_activations(torch.randn(1, 4, 7), "forward", "fp32") + \
            encode_tokens(torch.zeros(1, 4), torch.zeros(1, 4), CONFIG.vocab_size)
        rogue.dial(server.peer_id).send(encode_message(fwd, wrong_width))
        poll(lambda: server.counters.frames_refused >= 1, 10, "the bad frame to be refused")
        assert server.bans.banned(rogue.peer_id, time.monotonic())
        assert server.counters.forwards == 0 and server.counters.steps_applied == 0
        assert all(torch.equal(p, before[n]) for n, p in workers[1].parameters().items())

        # 3. a bad-mouthed stage: nothing stops the honest driver's steps
        x = torch.randint(0, CONFIG.vocab_size, (4, 9))
        first = driver.train_step(x[:, :-1], x[:, 1:], 0, lr_at(0, optim))
        for step in range(1, 4):
            result = driver.train_step(x[:, :-1], x[:, 1:], step, lr_at(step, optim))
        assert result.loss < first.loss
        # the last step's apply reaches the stage after the driver has moved on
        poll(lambda: server.counters.steps_applied == 4, 30, "the stage to apply the last step")
        assert driver.counters.microbatches == 8
    finally:
        rogue.close()
        driver.close()
        server.close()
