"""A stage server answers each message up the stream it came down, on real hivemind P2P daemons on loopback.

Two peers feed one middle stage in one step, each on its own stream (what several peers of a stage serving at once
need): each gets the backward of its own micro-batch, and the step's ``done`` goes to the peer that sent the
``finish``. A malformed backward bans the peer below that sent it, not a peer above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import hivemind
import pytest
import torch
from stage_parts import CONFIG3, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.links import Conn, StageLinks
from hlbp.peer.swarm.server import StageServer
from hlbp.peer.swarm.worker import wire_norm, wire_scale
from hlbp.peer.train.trainer import OptimConfig, lr_at
from hlbp.protocol.activations import encode_activations
from hlbp.protocol.stagewire import StageMessage, encode_message, encode_tokens

TOKENS = 4


class Peer:
    """A peer speaking the stage protocol over its own real links, keeping what it receives."""

    def __init__(self, dht: hivemind.DHT) -> None:
        self.got: list[tuple[Conn, StageMessage, bytes]] = []
        self._lock = threading.Lock()
        self.links = StageLinks(dht, self._on_message, lambda c: None, lambda p, e: None, lambda p: True, 1 << 22)
        self.peer_id = self.links.peer_id

    def _on_message(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        with self._lock:
            self.got.append((conn, msg, body))

    def received(self, op: str) -> list[tuple[Conn, StageMessage, bytes]]:
        with self._lock:
            return [g for g in self.got if g[1].op == op]


@pytest.fixture
def peers() -> Iterator[tuple[list[hivemind.DHT], list[Peer]]]:
    with started_dhts(4) as nodes:
        made = [Peer(d) for d in nodes[1:]]
        try:
            yield nodes, made
        finally:
            for p in made:
                p.links.close()


def _frame(d_model: int) -> bytes:
    return encode_activations(torch.randn(1, TOKENS, d_model), "forward", "fp32") + \
        encode_tokens(torch.zeros(1, TOKENS), torch.zeros(1, TOKENS), CONFIG3.vocab_size)


def _middle(dht: hivemind.DHT, members: set[str]) -> tuple[StageServer, Any]:
    optim = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)
    worker = stage_workers(optim, 1, n_stages=3)[0]
    return StageServer(dht, worker, dense_codec(), CONFIG3.vocab_size, lambda p: p in members, 4096), optim


def test_two_peers_above_each_get_their_own_backward_and_the_finisher_gets_the_done(
        peers: tuple[list[hivemind.DHT], list[Peer]]) -> None:
    dhts, (a, b, below) = peers
    server, optim = _middle(dhts[0], {a.peer_id, b.peer_id, below.peer_id})
    codec = dense_codec()
    try:
        route = (below.peer_id,)
        for mb, sender in enumerate((a, b)):  # one step of two micro-batches, one from each peer above
            fwd = StageMessage("fwd", session=5, step=0, mb=mb, count=2, weight=0.5, route=route)
            sender.links.dial(server.peer_id).send(encode_message(fwd, _frame(CONFIG3.d_model)))
            # the second arrives before the first's backward: the server has seen both streams by then
            poll(lambda n=mb + 1: len(below.received("fwd")) == n, 30, f"forward {mb} to reach the stage below")
        for conn, msg, _ in below.received("fwd"):  # the stage below answers each on the stream it came on
            grad = codec.encode_backward(torch.randn(1, TOKENS, CONFIG3.d_model), msg.mb)
            conn.send(encode_message(StageMessage("bwd", session=5, step=0, mb=msg.mb, count=2, sumsq=1.0), grad))
        poll(lambda: a.received("bwd") and b.received("bwd"), 30, "each peer above to get a backward")
        time.sleep(0.3)  # nothing else is on its way: a misrouted second backward would have come with the first
        assert [m.mb for _, m, _ in a.received("bwd")] == [0]
        assert [m.mb for _, m, _ in b.received("bwd")] == [1]

        lr = lr_at(0, optim)
        finish = StageMessage("finish", session=5, step=0, count=2, lr=lr, opt_step=0, max_norm=optim.grad_clip,
                              route=route, tokens=2 * TOKENS)
        b.links.dial(server.peer_id).send(encode_message(finish))
        poll(lambda: below.received("finish"), 30, "the finish to be passed down")
        conn, passed, _ = below.received("finish")[0]
        total = wire_norm(passed.sumsq)
        conn.send(encode_message(StageMessage("done", session=5, step=0, opt_step=0, lr=lr, sumsq=total,
                                              scale=wire_scale(total, optim.grad_clip), tokens=2 * TOKENS)))
        poll(lambda: server.counters.steps_applied == 1, 30, "the stage to apply the step")
        poll(lambda: b.received("done"), 30, "the done to reach the peer that sent the finish")
        assert not a.received("done")
    finally:
        server.close()


def test_a_malformed_backward_bans_the_peer_below_that_sent_it(
        peers: tuple[list[hivemind.DHT], list[Peer]]) -> None:
    dhts, (a, _, below) = peers
    server, _ = _middle(dhts[0], {a.peer_id, below.peer_id})
    try:
        fwd = StageMessage("fwd", session=5, step=0, mb=0, count=1, route=(below.peer_id,))
        a.links.dial(server.peer_id).send(encode_message(fwd, _frame(CONFIG3.d_model)))
        poll(lambda: below.received("fwd"), 30, "the forward to reach the stage below")
        conn = below.received("fwd")[0][0]
        bad = encode_activations(torch.randn(1, TOKENS, 7), "backward", "fp32")  # the wrong width
        conn.send(encode_message(StageMessage("bwd", session=5, step=0, mb=0), bad))
        poll(lambda: server.counters.frames_refused >= 1, 30, "the bad backward to be refused")
        now = time.monotonic()
        assert server.bans.banned(below.peer_id, now)
        assert not server.bans.banned(a.peer_id, now)
    finally:
        server.close()
