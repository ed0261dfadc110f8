"""A stage server's part in its driver's validation: ``eval`` micro-batches through the stage at its own weights,
and their ``loss`` answers on the way back up.

An ``eval`` runs one validation batch through the stage without keeping anything for a backward; the last stage
answers with its loss, which each stage above passes up the stream the ``eval`` came down. This traffic shares the
stage's streams and compute thread with training (:class:`~hlbp.peer.swarm.server.StageServer` hands evaluation
messages here and runs the jobs) but none of its state.

A peer further down the route that dies under an evaluation would leave the driver waiting out its timeout (a
driver that waits misses rounds): when the stream to the peer an ``eval`` was passed to closes, or that peer cannot
be dialled, the stage sends a ``fail`` naming it up the ``eval``'s own stream, with the ``eval``'s session and step,
and the driver's scoring pass ends at once (:class:`~hlbp.peer.swarm.scoring.ChainScorer`). A ``fail`` that comes
up from that peer about the same evaluation is passed up the same way. A ``loss`` counts only from the peer its
``eval`` was passed to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hlbp.peer.swarm.guardrelay import PassOn
from hlbp.peer.swarm.links import Conn
from hlbp.peer.swarm.worker import StageWorker
from hlbp.protocol.stagewire import Reason, StageMessage, decode_targets, encode_message

Key = tuple[int, int, int, int]  # an evaluation micro-batch: (session, step, mb, attempt)

MAX_PASSED = 1024
"""Evaluation micro-batches remembered while their answers are awaited (a validation pass is a few)."""


def _key(msg: StageMessage) -> Key:
    return msg.session, msg.step, msg.mb, msg.attempt


@dataclass(frozen=True)
class Passed:
    """An evaluation micro-batch this stage passed on: the stream it came down (where its answer goes), the peer it
    went to, and the driver's session and step it belongs to."""

    up: Conn
    down: str
    session: int
    step: int


class EvalRelay:
    """Evaluation traffic of one stage server. ``pass_on``: sends a stage output on down its route
    (:meth:`StageServer._pass_on`); ``counted()``: one evaluation micro-batch run."""

    def __init__(self, worker: StageWorker, vocab_size: int, pass_on: PassOn, counted: Callable[[], None]) -> None:
        self.worker, self.vocab_size = worker, vocab_size
        self.is_last = worker.stage.is_last
        self._pass_on, self._counted = pass_on, counted
        self._lock = threading.Lock()  # the compute thread adds, the links' loop thread answers and closes
        self._passed: dict[Key, Passed] = {}  # where each evaluation micro-batch came from and went

    def run(self, conn: Conn, msg: StageMessage, received: Any, window: bytes, shape: tuple[int, int]) -> None:
        """Compute thread: one evaluation micro-batch through this stage (its frame decoded): scored and answered
        on the last stage, else passed on down its route."""
        targets = decode_targets(window, shape, self.vocab_size)
        self._counted()
        if self.is_last:
            loss = self.worker.eval_loss(received.tensor, targets)
            conn.send(encode_message(StageMessage("loss", session=msg.session, step=msg.step, mb=msg.mb,
                                                  attempt=msg.attempt, loss=min(loss, 1e6))))
            return
        passed, key = Passed(conn, msg.route[0], msg.session, msg.step), _key(msg)
        with self._lock:
            while len(self._passed) >= MAX_PASSED:  # answers that never came: the oldest go
                del self._passed[next(iter(self._passed))]
            self._passed[key] = passed
        out = self.worker.forward(msg.mb, msg.attempt, received.tensor, train=False)

        def unreachable(exc: ConnectionError) -> None:
            with self._lock:
                self._passed.pop(key, None)
            _fail_up(passed, Reason.UNREACHABLE, str(exc))

        self._pass_on(msg, received, out, window, unreachable)

    def answered(self, conn: Conn, msg: StageMessage) -> None:
        """A ``loss`` from downstream: passed up the stream its ``eval`` came down, when it comes from the peer that
        ``eval`` was passed to."""
        with self._lock:
            passed = self._passed.get(_key(msg))
            if passed is None or passed.down != conn.peer:
                return
            del self._passed[_key(msg)]
        passed.up.send(encode_message(msg))

    def failed(self, conn: Conn, msg: StageMessage) -> bool:
        """A ``fail`` from downstream: passed up (and True) when it is about an evaluation this stage passed to
        that peer (same session and step); the evaluation's other micro-batches through it end with it."""
        with self._lock:
            ended = self._take(lambda p: p.down == conn.peer and (p.session, p.step) == (msg.session, msg.step))
        for passed in ended:
            passed.up.send(encode_message(msg))
        return bool(ended)

    def closed(self, peer: str) -> None:
        """The stream to ``peer`` closed: every evaluation passed to it ends with a ``fail`` naming it."""
        with self._lock:
            ended = self._take(lambda p: p.down == peer)
        for passed in ended:
            _fail_up(passed, Reason.STREAM_CLOSED, "the stream closed with an evaluation in flight")

    def _take(self, which: Callable[[Passed], bool]) -> set[Passed]:
        """Drop the passed evaluations ``which`` selects (the lock held); one of them per evaluation (stream it came
        down, session and step), which is what a ``fail`` answers."""
        taken = {k: p for k, p in self._passed.items() if which(p)}
        for k in taken:
            del self._passed[k]
        return set(taken.values())


def _fail_up(passed: Passed, code: Reason, reason: str) -> None:
    """A ``fail`` naming the peer ``passed`` went to, up the stream it came down, labelled with its session and step
    (what the driver's scoring pass waits on)."""
    passed.up.send(encode_message(StageMessage("fail", session=passed.session, step=passed.step, peer=passed.down,
                                               code=code, reason=reason[:200])))
