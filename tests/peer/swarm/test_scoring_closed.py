"""A driver's evaluation through its chain ends when the chain's first peer dies, on real hivemind P2P daemons.

The stage peer takes the ``eval`` frame and never answers; then its DHT and p2pd go down, as when its machine is
killed. The evaluation gives up as soon as the stream closes, not after its timeout, and names the peer
(``ChainBroke``), which the driver bans as it bans a peer that fails a step: a driver waiting out 30 s there missed a
dozen rounds of a fast run before its steps moved to a standby (``test_stage_faults.py``).
"""

from __future__ import annotations

import threading
import time

import torch
from stage_parts import CONFIG, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.events import EventQueue, StreamClosed
from hlbp.peer.swarm.links import StageLinks
from hlbp.peer.swarm.scoring import ChainBroke, ChainScorer
from hlbp.peer.train.trainer import OptimConfig
from hlbp.protocol.stagewire import StageMessage

TIMEOUT_S = 60.0  # the evaluation's own timeout: far beyond what the test allows it


def test_an_evaluation_ends_when_the_first_peer_of_its_chain_dies() -> None:
    with started_dhts(2) as (mine, theirs):
        inbox = EventQueue()
        links = StageLinks(mine, lambda conn, msg, body: None, lambda conn: inbox.put(StreamClosed(conn)),
                           lambda peer, error: None, lambda peer: True, 1 << 22)
        got: list[StageMessage] = []
        silent = StageLinks(theirs, lambda conn, msg, body: got.append(msg), lambda conn: None,
                            lambda peer, error: None, lambda peer: True, 1 << 22)
        worker = stage_workers(OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10), 0)[0]
        scorer = ChainScorer(worker, dense_codec(), CONFIG.vocab_size, links, inbox)
        x = torch.randint(0, CONFIG.vocab_size, (1, 4))
        out: list[float | ChainBroke | None] = []
        took: list[float] = []

        def evaluate() -> None:
            started = time.monotonic()
            out.append(scorer.evaluate([silent.peer_id], session=1, step=0, batches=[(x, x)], timeout_s=TIMEOUT_S))
            took.append(time.monotonic() - started)

        thread = threading.Thread(target=evaluate, daemon=True)
        try:
            thread.start()
            poll(lambda: any(m.op == "eval" for m in got), 30.0, "the eval frame at the stage peer")
            theirs.shutdown()  # its p2pd goes with it: the stream to it breaks
            thread.join(timeout=TIMEOUT_S + 10)
        finally:
            silent.close()
            links.close()
    assert not thread.is_alive()
    assert out == [ChainBroke(silent.peer_id)]
    assert took[0] < TIMEOUT_S / 3, took
