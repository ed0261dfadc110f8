"""The end of each step at one stage peer: ``finish``, ``done``, the driver's ``apply``, a sibling's mirrored
``apply`` and ``abort``, run on the stage's compute thread.

The stage server (:class:`~hlbp.peer.swarm.server.StageServer`) decodes frames and runs micro-batches; when a
step's end arrives it hands it here. :class:`StepEnds` checks it against what this stage said about the step
(:class:`~hlbp.peer.swarm.stepend.StepLedger`), trades gradients first when several peers served the stage
(:class:`~hlbp.peer.swarm.siblings.SiblingTrades`), steps the worker, passes the end on down its route or back up,
and tells the round gate what the step contributed. Which stream a step's ``done`` goes up (:attr:`StepEnds.closer`)
and which round and phase step the step belongs to (:meth:`StepEnds.started`) live here too, since only the step's
end reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hlbp.peer.swarm.gate import RoundGate
from hlbp.peer.swarm.siblings import SiblingTrades, without_own
from hlbp.peer.swarm.stepend import StepLedger
from hlbp.peer.swarm.worker import StageStateError, StageWorker, finish_fault, wire_norm, wire_scale
from hlbp.protocol.stagewire import Reason, StageMessage, encode_message

if TYPE_CHECKING:
    from hlbp.peer.swarm.links import Conn

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class StepEnds:
    """Ends the steps of one stage peer (see the module docstring). ``queue_apply`` and ``queue_backward`` put a job
    on the compute thread at the priority of a step's apply or of a backward; ``send_up``, ``fail`` and ``bad`` are
    the server's: reply up the step's stream, send a ``fail`` naming a peer, ban a peer that broke the protocol."""

    def __init__(self, worker: StageWorker, links: Any, ledger: StepLedger, trades: SiblingTrades,
                 gate: RoundGate | None, max_tokens: int, counters: Any,
                 on_step: Callable[[StageMessage, bool], None] | None, queue_apply: Callable[[Job], None],
                 queue_backward: Callable[[Job], None], send_up: Callable[[StageMessage], None],
                 fail: Callable[[str, Reason, str], None], bad: Callable[[str, str], None]) -> None:
        self.worker, self.links, self.ledger, self.trades, self.gate = worker, links, ledger, trades, gate
        self.max_tokens, self.counters, self.on_step = max_tokens, counters, on_step
        self._queue_apply, self._queue_backward = queue_apply, queue_backward
        self._send_up, self._fail, self._bad = send_up, fail, bad
        self.closer: Conn | None = None  # the stream the step's finish came down (set and cleared on the compute thread)
        self.round: int | None = None  # the outer round of the step under way, as its frames say
        self.inner = 0  # the steps its phase applied before it, as its frames say (0: a phase's first)

    def started(self, msg: StageMessage) -> None:
        """Compute thread: the first micro-batch of a new step arrived; its finish has yet to come."""
        self.round, self.inner, self.closer = msg.round, msg.inner, None

    # --- links' loop thread: checked here, queued for the compute thread --------------------------------------------

    def finish_arrived(self, conn: Conn, msg: StageMessage) -> None:
        """The driver's ``finish`` from upstream: a rate off the schedule is not run and not passed down."""
        fault = finish_fault(msg.lr, msg.opt_step, msg.max_norm, self.worker.optim)
        if fault is not None:  # its sender is banned and told why
            self._bad(conn.peer, fault)
            self._fail(conn.peer, Reason.BAD_FINISH, fault)
            return
        self._queue_backward(lambda: self.finish(conn, msg))

    def done_arrived(self, conn: Conn, msg: StageMessage) -> None:
        """A ``done`` from downstream: applied and passed up when it agrees with the finish this stage passed
        down; otherwise the step is dropped here and the driver re-runs it on another chain."""
        fault = self.ledger.done_fault(msg)
        if fault is not None:
            self._refuse_end(conn, msg, fault)
            return
        self._queue_apply(lambda: self.apply(msg))
        self._send_up(msg)

    def apply_arrived(self, conn: Conn, msg: StageMessage) -> None:
        """The driver's ``apply`` of a step, from upstream: checked against the schedule and the norm this stage
        sent up, and queued ahead of the next step's micro-batches (:meth:`pass_apply`). One that does not add up
        drops the step here, is not passed on, and names its sender (the stages below drop the step when the next
        one starts)."""
        fault = self.ledger.apply_fault(msg, self.worker.optim)
        if fault is not None:
            self._refuse_end(conn, msg, fault)
            return
        self._queue_apply(lambda: self.pass_apply(msg))

    def _refuse_end(self, conn: Conn, msg: StageMessage, fault: str) -> None:
        """A step's end that does not add up: its sender is banned, the step is dropped here (stepped with nothing,
        so the round gate and the worker move on) and the driver told to re-run it on another chain."""
        self._bad(conn.peer, fault)
        self._queue_apply(lambda: self.apply(replace(msg, scale=0.0, tokens=0, round_end=False)))
        self._fail(conn.peer, Reason.BAD_DONE, fault)

    # --- compute thread ----------------------------------------------------------------------------------------------

    def pass_apply(self, msg: StageMessage) -> None:
        """Pass a checked ``apply`` down its route (dialling waits on the links' loop), then step. Queued first, it
        leaves before this stage sends on any micro-batch of the next step."""
        if msg.route:
            try:
                self.links.dial(msg.route[0]).send(encode_message(replace(msg, route=msg.route[1:])))
            except ConnectionError as exc:  # the stages below drop the step when the next one reaches them
                logger.warning("the apply of step %d could not reach %s: %s", msg.step, msg.route[0][:12], exc)
        self.apply(msg)

    def finish(self, conn: Conn, msg: StageMessage) -> None:
        """Add this stage's squared norm to the ``finish`` and pass it down; on the last stage, step and send the
        ``done`` back up. When the finish names other peers of this stage, their gradients are traded first."""
        self.closer = conn
        others = msg.peers[:msg.per[0]] if msg.per else ()
        if others and self.trades.peers_of(msg.session, msg.step) != tuple(sorted({self.links.peer_id, *others})):
            if (msg.session, msg.step) != (self.worker.session, self.worker.step):
                self._fail(self.links.peer_id, Reason.INCOMPLETE, f"finish of step {msg.step}: none of it is here")
                return
            # several peers served this stage: trade gradients first, then finish with the whole step's
            self.trades.lead(msg, others, lambda: self.finish(conn, msg))
            return
        msg = without_own(msg)
        if (msg.session, msg.step) != (self.worker.session, self.worker.step) or \
                len(self.worker.accumulated) != msg.count:
            have = len(self.worker.accumulated) if msg.step == self.worker.step else 0
            self._fail(self.links.peer_id, Reason.INCOMPLETE,
                       f"finish of step {msg.step}: {have} of {msg.count} micro-batches accumulated here")
            return
        total = msg.sumsq + self.worker.sumsq()
        if msg.route:
            try:
                down = self.links.dial(msg.route[0])
            except ConnectionError as exc:
                self._fail(msg.route[0], Reason.UNREACHABLE, str(exc))
                return
            # what a done for this step must agree with: the driver's rate and at least the norm counted so far
            self.ledger.passed_down(msg, total)
            down.send(encode_message(replace(msg, sumsq=min(total, 1e300), route=msg.route[1:])))
            return
        done = StageMessage("done", session=msg.session, step=msg.step, opt_step=msg.opt_step, lr=msg.lr,
                            sumsq=wire_norm(total), scale=wire_scale(total, msg.max_norm), tokens=msg.tokens,
                            round_end=msg.round_end)
        self.apply(done)
        self._send_up(done)

    def mirror_apply(self, sender: str, msg: StageMessage) -> None:
        """The step's apply from the peer of this stage that led its trade (checked against the sum's norm
        computed here) is applied as a mirror."""
        fault = self.trades.apply_fault(sender, msg)
        if fault is not None:
            self._bad(sender, fault)
            return
        self.apply(msg, mirror=True)

    def apply(self, msg: StageMessage, mirror: bool = False) -> None:
        """Step (or skip) the step under way. A ``mirror`` (a peer of a shared stage that did not lead its trade)
        steps the same, and its round gate does not count the step: the leader's contribution carries it."""
        if (msg.session, msg.step) != (self.worker.session, self.worker.step):
            raise StageStateError(f"done of step {msg.step}, this stage is at step {self.worker.step}")
        ok = msg.scale > 0 and self.worker.apply(msg.lr, msg.scale)
        if not ok:
            self.worker.reset()
        self.worker.applied_with(msg.session, msg.step, self.trades.peers_of(msg.session, msg.step))
        self.trades.applied(msg.session, msg.step)
        if not mirror and msg.scale > 0:
            self.trades.pass_apply(msg)
        self.counters.steps_applied += ok
        self.counters.steps_skipped += not ok
        self.worker.step = -1  # applied: the next fwd of this session starts the next step afresh
        if self.gate is not None:
            # the driver's count weighs this stage's contribution in token-weighted runs: never above a batch
            self.gate.leave(ok and not mirror, min(msg.tokens, self.max_tokens), msg.round_end, self.round)
        if self.on_step is not None:
            self.on_step(msg, ok)

    def abort(self, msg: StageMessage) -> None:
        """The driver gave the step up: drop what this stage accumulated and pass the abort down its route."""
        if msg.session == self.worker.session:
            self.worker.reset()
            if self.gate is not None:
                self.gate.leave(False)
        if msg.route:
            try:
                self.links.dial(msg.route[0], timeout=3).send(encode_message(replace(msg, route=msg.route[1:])))
            except ConnectionError:
                pass
