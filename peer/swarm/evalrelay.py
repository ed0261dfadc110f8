"""A stage server's part in its driver's validation: ``eval`` micro-batches through the stage at its own weights,
and their ``loss`` answers on the way back up.

An ``eval`` runs one validation batch through the stage without keeping anything for a backward; the last stage
answers with its loss, which each stage above passes up the stream the ``eval`` came down. This traffic shares the
stage's streams and compute thread with training (:class:`~hlbp.peer.swarm.server.StageServer` hands evaluation
messages here and runs the jobs) but none of its state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hlbp.peer.swarm.guardrelay import PassOn
from hlbp.peer.swarm.links import Conn
from hlbp.peer.swarm.worker import StageWorker
from hlbp.protocol.stagewire import Reason, StageMessage, decode_targets, encode_message


class EvalRelay:
    """Evaluation traffic of one stage server. ``pass_on``: sends a stage output on down its route
    (:meth:`StageServer._pass_on`); ``counted()``: one evaluation micro-batch run; ``fail(peer, code, reason)``:
    reports a peer of the route that could not be reached."""

    def __init__(self, worker: StageWorker, vocab_size: int, pass_on: PassOn, counted: Callable[[], None],
                 fail: Callable[[str, Reason, str], None]) -> None:
        self.worker, self.vocab_size = worker, vocab_size
        self.is_last = worker.stage.is_last
        self._pass_on, self._counted, self._fail = pass_on, counted, fail
        self._upstream: dict[tuple[int, int], Conn] = {}  # (mb, attempt) -> where its loss goes

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
        self._upstream[(msg.mb, msg.attempt)] = conn
        out = self.worker.forward(msg.mb, msg.attempt, received.tensor, train=False)
        self._pass_on(msg, received, out, window,
                      lambda exc: self._fail(msg.route[0], Reason.UNREACHABLE, str(exc)))

    def answered(self, msg: StageMessage) -> None:
        """A ``loss`` from downstream: passed up the stream its ``eval`` came down."""
        up = self._upstream.pop((msg.mb, msg.attempt), None)
        if up is not None:
            up.send(encode_message(msg))
