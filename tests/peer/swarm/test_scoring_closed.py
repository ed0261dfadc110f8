"""A driver's scoring passes through its chain end when a peer of the chain dies, on real hivemind P2P daemons.

The dying stage peer takes the ``eval`` (or ``guard``) frame and never answers; then its DHT and p2pd go down, as
when its machine is killed. The evaluation gives up as soon as the stream closes, not after its timeout, and names
the peer (``ChainBroke``), which the driver bans as it bans a peer that fails a step: a driver waiting out 30 s
there missed a dozen rounds of a fast run before its steps moved to a standby (``test_stage_faults.py``). When the
dying peer is further down the chain, the stage server in front of it tells: a ``fail`` naming it for an
evaluation, an unscored answer for a guard (and its own slot stops waiting for the round's loss too).
"""

from __future__ import annotations

import threading
import time

import torch
from stage_parts import CONFIG, CONFIG3, dense_codec, stage_workers, started_dhts

from hlbp.peer.sim.launcher import poll
from hlbp.peer.swarm.events import EventQueue, StreamClosed, decode_answer
from hlbp.peer.swarm.guardslot import GuardSlot
from hlbp.peer.swarm.links import StageLinks
from hlbp.peer.swarm.scoring import ChainBroke, ChainScorer
from hlbp.peer.swarm.server import StageServer
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


def _timed(call, out: list, took: list) -> threading.Thread:
    def run() -> None:
        started = time.monotonic()
        out.append(call())
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_scoring_pass_ends_when_a_peer_further_down_its_chain_dies() -> None:
    """Driver -> a real middle stage server -> a last peer that takes the frame and dies. An evaluation ends with
    ``ChainBroke`` naming the last peer (the middle's ``fail``); a guard (through a second such peer) ends unscored
    on both the driver and the middle stage, whose slot was waiting for the round's loss."""
    optim = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)
    first, middle_worker = stage_workers(optim, 0, 1, n_stages=3)
    with started_dhts(4) as (mine, middles, *lasts):
        inbox = EventQueue()
        links = StageLinks(mine, lambda conn, msg, body: inbox.put(decode_answer(conn, msg, body)),
                           lambda conn: inbox.put(StreamClosed(conn)), lambda peer, error: None, lambda peer: True,
                           1 << 22)
        slot = GuardSlot()
        middle = StageServer(middles, middle_worker, dense_codec(), CONFIG3.vocab_size, lambda peer: True, 4096,
                             slot=slot)
        got: list[list[StageMessage]] = [[], []]
        silent = [StageLinks(dht, lambda conn, msg, body, seen=seen: seen.append(msg), lambda conn: None,
                             lambda peer, error: None, lambda peer: True, 1 << 22) for dht, seen in zip(lasts, got)]
        scorer = ChainScorer(first, dense_codec(), CONFIG3.vocab_size, links, inbox)
        x = torch.randint(0, CONFIG3.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
        round_ = 5
        slot.served(round_)  # the middle stage served the round's steps: it waits for the chain's guard loss
        evaluated, guarded, on_stage = [], [], []
        took: list[float] = []
        try:
            chain = [middle.peer_id, silent[0].peer_id]
            thread = _timed(lambda: scorer.evaluate(chain, 1, 7, [(x, x)], TIMEOUT_S), evaluated, took)
            poll(lambda: any(m.op == "eval" for m in got[0]), 30.0, "the eval frame at the last peer")
            lasts[0].shutdown()  # its p2pd goes with it: the middle's stream to it breaks
            thread.join(timeout=TIMEOUT_S + 10)

            chain = [middle.peer_id, silent[1].peer_id]
            candidate = {n: p.detach().clone() for n, p in middle_worker.stage.named_parameters()}
            stage = _timed(lambda: slot.score(round_, candidate, grace_s=TIMEOUT_S, timeout_s=TIMEOUT_S), on_stage,
                           took)
            params = {n: p.detach().clone() for n, p in first.stage.named_parameters()}
            guard = _timed(lambda: scorer.guard(chain, 1, 8, round_, params, (x, x), TIMEOUT_S), guarded, took)
            poll(lambda: any(m.op == "guard" for m in got[1]), 30.0, "the guard frame at the last peer")
            lasts[1].shutdown()
            for t in (stage, guard):
                t.join(timeout=TIMEOUT_S + 10)
        finally:
            for links_ in (*silent, links):
                links_.close()
            middle.close()
    assert evaluated == [ChainBroke(silent[0].peer_id)]
    assert guarded == [None] and on_stage == [None]
    assert max(took) < TIMEOUT_S / 3, took
