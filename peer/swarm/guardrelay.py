"""A stage server's part in its swarm's loss guard: ``guard`` micro-batches through the stage at a round's
candidate result, and their ``gloss`` answers on the way back up.

A ``guard`` runs the run's guard batch through the stage at its round's candidate result, held in a
:class:`~hlbp.peer.swarm.guardslot.GuardSlot` while the round is being committed (or waits there for it), and its
``gloss`` answer is recorded in the slot as it passes back up. This traffic scores a round before it is committed;
it shares the stage's streams and compute thread with training (:class:`~hlbp.peer.swarm.server.StageServer`
hands guard messages here and runs the jobs this queues) but none of its state.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.swarm.guardslot import MAX_HELD, Delivery, GuardSlot
from hlbp.peer.swarm.links import Conn
from hlbp.peer.swarm.worker import StageWorker
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import Reason, StageMessage, decode_targets, encode_message, split_body

logger = logging.getLogger(__name__)

PassOn = Callable[[StageMessage, Any, torch.Tensor, bytes, Callable[[ConnectionError], None]], None]


class GuardRelay:
    """Guard traffic of one stage server. ``slot``: the round's candidate held under guard (None: no guard served,
    every guard is answered unscored); ``queue(job)``: runs a job on the server's compute thread; ``pass_on``: sends
    a stage output on down its route (:meth:`StageServer._pass_on`); ``counted()``: one guard micro-batch run."""

    def __init__(self, slot: GuardSlot | None, worker: StageWorker, codec: ActivationCodec, vocab_size: int,
                 queue: Callable[[Callable[[], None]], None], pass_on: PassOn, counted: Callable[[], None]) -> None:
        self.slot, self.worker, self.codec, self.vocab_size = slot, worker, codec, vocab_size
        self.is_last = worker.stage.is_last
        self._queue, self._pass_on, self._counted = queue, pass_on, counted
        self._lock = threading.Lock()
        # (round, mb) -> (where its gloss goes, the guard as it came: the next peer of its route is the one it was
        # passed on to, whose gloss alone counts)
        self._upstream: dict[tuple[int, int], tuple[Conn, StageMessage]] = {}

    def arrived(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        """A guard from upstream: queued at once when its round's candidate is held under guard, else kept until it
        is (:meth:`GuardSlot.deliver`); one this stage will not run is answered with an unscored ``gloss``, so its
        driver stops waiting and every stage of the chain judges the round by its norms alone."""
        slot = self.slot
        if slot is None or msg.mb >= MAX_HELD:
            self._unscored(conn, msg)
            return

        def run() -> None:
            self._queue(lambda: self._guard(conn, msg, body))

        outcome = slot.deliver(msg.round, run, lambda: self._unscored(conn, msg))
        if outcome is Delivery.RUN:
            run()
        elif outcome is Delivery.REFUSED:
            self._unscored(conn, msg)

    def answered(self, conn: Conn, msg: StageMessage) -> None:
        """A ``gloss`` from downstream: recorded and passed up, only as the answer to a guard this stage passed
        on, from the peer it passed it to."""
        with self._lock:
            key = (msg.round, msg.mb)
            up, guard = self._upstream.get(key, (None, None))
            if up is None or guard is None or guard.route[0] != conn.peer:
                return
            del self._upstream[key]
        if msg.code == Reason.UNSCORED:
            self._give_up(up, guard)
            return
        if self.slot is not None:
            self.slot.record(msg.round, msg.mb, msg.loss)
        up.send(encode_message(msg))

    def closed(self, peer: str) -> None:
        """The stream to ``peer`` closed: every guard passed to it is answered unscored, up its stream and to this
        stage's slot, so that neither the driver nor this stage waits out its timeout for a loss that cannot come."""
        with self._lock:
            ended = {k: v for k, v in self._upstream.items() if v[1].route[0] == peer}
            for k in ended:
                del self._upstream[k]
        for up, guard in ended.values():
            self._give_up(up, guard)

    def _give_up(self, up: Conn, guard: StageMessage) -> None:
        """A guard this stage passed on will bring no loss: answered unscored up its stream, and this stage's slot
        stops waiting for its round's."""
        if self.slot is not None:
            self.slot.unscored(guard.round)
        self._unscored(up, guard)

    def _unscored(self, conn: Conn, msg: StageMessage) -> None:
        conn.send(encode_message(StageMessage("gloss", session=msg.session, step=msg.step, mb=msg.mb,
                                              round=msg.round, code=Reason.UNSCORED)))

    def _guard(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        """One guard micro-batch through this stage at its round's candidate: passed on down its route, or, on the
        last stage, scored, recorded and answered with a ``gloss``."""
        slot = self.slot
        assert slot is not None
        params = slot.params(msg.round)
        if params is None:  # decided meanwhile
            self._unscored(conn, msg)
            return
        start = time.perf_counter()
        frame, window = split_body(body, self.vocab_size)
        received = self.codec.decode_forward(frame)
        shape = (received.tensor.shape[0], received.tensor.shape[1])
        targets = decode_targets(window, shape, self.vocab_size)
        self._counted()
        if self.is_last:
            loss = self.worker.eval_loss_at(params, received.tensor, targets)
            loss = min(loss, 1e6) if math.isfinite(loss) else 1e6  # a non-finite loss travels as the largest
            slot.record(msg.round, msg.mb, loss)
            conn.send(encode_message(StageMessage("gloss", session=msg.session, step=msg.step, mb=msg.mb,
                                                  round=msg.round, loss=loss,
                                                  busy=(time.perf_counter() - start,))))
            return
        if not msg.route:
            raise ProtocolError("a guard with no route past a stage that is not the last")
        out = self.worker.forward_at(params, received.tensor)
        with self._lock:
            self._upstream = {k: v for k, v in self._upstream.items() if k[0] >= msg.round}
            self._upstream[(msg.round, msg.mb)] = (conn, msg)

        def unreachable(exc: ConnectionError) -> None:
            logger.info("the guard of round %d could not reach %s: %s", msg.round, msg.route[0][:12], exc)
            with self._lock:
                self._upstream.pop((msg.round, msg.mb), None)
            self._give_up(conn, msg)

        self._pass_on(msg, received, out, window, unreachable)
