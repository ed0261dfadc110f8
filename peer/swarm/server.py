"""A stage peer (stage 1 or later) serving forward and backward on its stage streams.

Messages arrive on the links' loop thread (:mod:`hlbp.peer.swarm.links`) and become jobs on one compute thread,
which decodes the frame with the run's codec, runs the :class:`~hlbp.peer.swarm.worker.StageWorker`, encodes the
answer and sends it on. Jobs run by priority: applying a step first, then backward, then forward, so a stage
drains the step under way before it starts new micro-batches and never computes the next step's forward with the
last step's weights.

The flow of one micro-batch at stage s: ``fwd`` from upstream → forward → ``fwd`` to the next peer of its route
(or, on the last stage, loss and backward at once) → ``bwd`` from downstream → backward → ``bwd`` upstream. The
``bwd`` that completes this stage's accumulation carries up its squared gradient norm plus the later stages'
(:class:`~hlbp.peer.swarm.stepend.StepLedger`); the driver's ``apply`` then comes down ahead of the next step's
micro-batches, is checked against that norm, passed on and queued before them. A step whose norms did not come up
complete ends the older way: ``finish`` down the chain summing the norms, the last stage's ``done`` back up, each
stage queueing its AdamW step before it passes ``done`` on (:class:`~hlbp.peer.swarm.ending.StepEnds` runs a
step's end, trading gradients first when several peers served the stage). Every answer goes up the stream its cause came down: a
micro-batch's ``bwd`` on the stream of its ``fwd``, a step's ``done`` on the stream of its ``finish``, so peers
above that feed this stage in one step each hear about their own micro-batches.

Guard traffic (a round's candidate scored through the chain before it is committed) and validation traffic share
the streams and the compute thread; :class:`~hlbp.peer.swarm.guardrelay.GuardRelay` and
:class:`~hlbp.peer.swarm.evalrelay.EvalRelay` own them.

Failures: a downstream stream that closes with micro-batches still waiting for their backward, or a peer that
cannot be dialled, becomes a ``fail`` naming that peer, sent upstream to the driver, which re-runs the step's
micro-batches through another chain. A frame that does not decode bans its sender (with backoff), whichever side
of the stage it came from, and is dropped; it is never applied and never stops the stage.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.swarm.ending import StepEnds
from hlbp.peer.swarm.evalrelay import EvalRelay
from hlbp.peer.swarm.gate import RoundGate
from hlbp.peer.swarm.guardrelay import GuardRelay
from hlbp.peer.swarm.guardslot import GuardSlot
from hlbp.peer.swarm.links import Conn, StageLinks
from hlbp.peer.swarm.routing import Bans
from hlbp.peer.swarm.siblings import SiblingTrades
from hlbp.peer.swarm.stepend import StepLedger
from hlbp.peer.swarm.transcript import Notary, sealed
from hlbp.peer.swarm.worker import StageStateError, StageWorker
from hlbp.protocol import ProtocolError
from hlbp.protocol.gradshare import max_share_bytes
from hlbp.protocol.stagewire import (
    DOWNSTREAM,
    MAX_MICROBATCHES,
    SIBLING,
    UPSTREAM,
    Reason,
    StageMessage,
    decode_targets,
    encode_message,
    split_body,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

APPLY, BACKWARD, CONTROL, FORWARD = 0, 1, 2, 3  # job priorities, lowest first


@dataclass
class StageCounters:
    """What a stage did; the summary and the Prometheus endpoint read these."""

    forwards: int = 0
    backwards: int = 0
    evals: int = 0
    steps_applied: int = 0
    steps_skipped: int = 0  # non-finite gradients: the step was dropped on every stage
    busy_s: float = 0.0  # seconds of compute (decode, forward/backward, encode)
    frames_refused: int = 0  # frames that broke the protocol (their senders were banned)
    stale: int = 0  # backward frames of a superseded attempt or step, dropped
    fails_sent: int = 0
    started: float = field(default_factory=time.perf_counter)


def max_body_bytes(codec: ActivationCodec, max_tokens: int, vocab_size: int) -> int:
    """The largest fwd/bwd body this stage accepts: a frame of ``max_tokens`` tokens plus their token window (at
    most two ids of 4 bytes per token: the targets and each row's first input)."""
    return int(codec.frame_bytes(max_tokens)["forward"] * max_tokens) + 8 * max_tokens + 64


@dataclass(frozen=True)
class Pending:
    """A micro-batch this stage passed down and awaits the backward of: the stream it came down (where its bwd
    goes), the peer it went to, and the seconds its forward took."""

    up: Conn
    down: str
    fwd_s: float


class StageServer:
    """Serves one stage of one swarm until :meth:`close`. ``accept(peer)`` says who may call it (from an earlier
    stage); ``sibling(peer)`` says which callers serve this same stage (they may only trade gradients,
    :mod:`hlbp.peer.swarm.siblings`)."""

    def __init__(self, dht: Any, worker: StageWorker, codec: ActivationCodec, vocab_size: int,
                 accept: Callable[[str], bool], max_tokens: int, bans: Bans | None = None,
                 on_step: Callable[[StageMessage, bool], None] | None = None, gate: RoundGate | None = None,
                 gate_timeout_s: float = 600.0, notary: Notary | None = None, slot: GuardSlot | None = None,
                 sibling: Callable[[str], bool] | None = None, trade_timeout_s: float = 20.0) -> None:
        self.worker, self.codec, self.vocab_size = worker, codec, vocab_size
        self.slot = slot  # the round's candidate parameters under the swarm's loss guard (None: no guard served)
        self.notary = notary  # signs what this stage sends, checks and keeps what it receives (commitments)
        self.gate, self.gate_timeout_s = gate, gate_timeout_s  # steps wait here while a round is exchanged
        self.max_tokens = max_tokens  # a step has at most this many tokens, whatever its driver claims
        self.is_last = worker.stage.is_last
        self.bans = bans or Bans()
        self.on_step = on_step
        self.counters = StageCounters()
        self._accept = accept
        self._sibling = sibling or (lambda _peer: False)
        # (priority, arrival, job, the peer whose frame the job decodes: blamed when it does not decode)
        self._jobs: queue.PriorityQueue[tuple[int, int, Callable[[], None], str]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        # Replies go up the stream their cause came down: a micro-batch's bwd on its fwd's stream, a step's done on
        # its finish's. Several peers of the stage above may feed this one in a step, each on its own stream.
        self._upstream: Conn | None = None  # the session's latest stream: where a fail without a cause goes
        self._session = -1
        self.ledger = StepLedger()  # what this stage said about the step under way, to check its end against
        self._pending: dict[tuple[int, int], Pending] = {}  # (mb, attempt) -> where it came from and went
        self.guard = GuardRelay(slot, worker, codec, vocab_size, lambda job: self._put(FORWARD, job), self._pass_on,
                                self._count_eval)
        self.evals = EvalRelay(worker, vocab_size, self._pass_on, self._count_eval)
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self.links = StageLinks(dht, self._on_message, self._on_closed, self._on_bad, self._may_call,
                                max_body_bytes(codec, max_tokens, vocab_size),
                                max_share_bytes(MAX_MICROBATCHES, worker.shapes()))
        self.peer_id = self.links.peer_id
        self.trades = SiblingTrades(worker, self.links, self.peer_id, lambda job: self._put(BACKWARD, job),
                                    self._fail, self._on_bad, trade_timeout_s, lambda job: self._put(FORWARD, job),
                                    lambda: self.ends.inner == 0)
        self.ends = StepEnds(worker, self.links, self.ledger, self.trades, gate, max_tokens, self.counters, on_step,
                             lambda job: self._put(APPLY, job), lambda job: self._put(BACKWARD, job), self._send_up,
                             self._fail, self._on_bad)
        self._thread = threading.Thread(target=self._compute_loop, name="hlbp-stage-compute", daemon=True)
        self._thread.start()

    # --- loop thread ------------------------------------------------------------------------------------------------

    def _may_call(self, peer: str) -> bool:
        return not self.bans.banned(peer, time.monotonic()) and (self._accept(peer) or self._sibling(peer))

    def _on_bad(self, peer: str, error: str) -> None:
        self.counters.frames_refused += 1
        seconds = self.bans.fail(peer, time.monotonic())
        if peer not in self._warned:
            self._warned.add(peer)
            logger.warning("stage peer %s sent a bad message (%s); banned for %.0f s", peer[:12], error, seconds)
        for conn in list(self.links.conns.values()):
            if conn.peer == peer:
                conn.close()

    def _on_message(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        allowed = UPSTREAM if conn.dialled else SIBLING if self._sibling(conn.peer) else DOWNSTREAM
        if msg.op not in allowed:
            self._on_bad(conn.peer, f"a {msg.op} message on a stream where only {sorted(allowed)} belong")
            return
        fault = None if self.notary is None else self.notary.receive(conn.peer, msg, body)
        if fault is not None:
            self._on_bad(conn.peer, fault)
            return
        if msg.op == "ping":
            # the driver waits before its next step (its round in the ping) while we exchange or are a round behind
            exchanging = self.gate is not None and not self.gate.ready_for(msg.round)
            conn.send(encode_message(StageMessage("pong", session=msg.session,
                                                  code=Reason.ROUND if exchanging else Reason.NONE)))
        elif msg.op in ("fwd", "eval"):
            with self._lock:
                if msg.session != self._session:
                    if self._session != -1:
                        logger.info("a new driver session %d from %s", msg.session, conn.peer[:12])
                    self._session = msg.session
                    self._pending.clear()
                self._upstream = conn
            self._put(FORWARD, lambda: self._forward(conn, msg, body), conn.peer)
        elif msg.op == "bwd":
            self._put(BACKWARD, lambda: self._backward(conn.peer, msg, body), conn.peer)
        elif msg.op == "finish":
            self.ends.finish_arrived(conn, msg)
        elif msg.op == "abort":
            self._put(APPLY, lambda: self.ends.abort(msg))
        elif msg.op == "share" and any(p != self.peer_id and not self._sibling(p) for p in msg.peers):
            # it would have this peer send its gradient to whomever it names: only peers of this stage trade
            self._on_bad(conn.peer, "a share naming a peer that does not serve this stage")
        elif msg.op == "share":
            self._put(BACKWARD, lambda: self.trades.received(conn.peer, msg, body), conn.peer)
        elif msg.op == "apply" and allowed is SIBLING:
            self._put(APPLY, lambda: self.ends.mirror_apply(conn.peer, msg), conn.peer)
        elif msg.op == "apply":
            self.ends.apply_arrived(conn, msg)
        elif msg.op == "done":
            self.ends.done_arrived(conn, msg)
        elif msg.op == "loss":
            self.evals.answered(conn, msg)
        elif msg.op == "guard":
            self.guard.arrived(conn, msg, body)
        elif msg.op == "gloss":
            self.guard.answered(conn, msg)
        elif msg.op == "fail" and not self.evals.failed(conn, msg):
            self._send_up(msg)

    def _on_closed(self, conn: Conn) -> None:
        if not conn.dialled:
            return
        self.evals.closed(conn.peer)
        self.guard.closed(conn.peer)
        with self._lock:
            lost = [key for key, pending in self._pending.items() if pending.down == conn.peer]
        if lost:
            logger.warning("stage stream to %s closed with %d micro-batches waiting for backward", conn.peer[:12],
                           len(lost))
            self._fail(conn.peer, Reason.STREAM_CLOSED, f"stream closed with {len(lost)} micro-batches in flight")

    def _send_up(self, msg: StageMessage, body: bytes = b"") -> None:
        """A step's end (done) or a failure, up the stream of the step's finish, else the session's latest."""
        up = self.ends.closer or self._upstream
        if up is not None:
            up.send(encode_message(msg, body))

    def _norms(self, msg: StageMessage, below: float | None) -> tuple[float, int]:
        """The norms the ``bwd`` of ``msg`` carries up (:meth:`StepLedger.norms`)."""
        return self.ledger.norms(msg, below, len(self.worker.accumulated), self.worker.sumsq)

    def _fail(self, peer: str, code: Reason, reason: str) -> None:
        self.counters.fails_sent += 1
        # after a step is applied the worker is at step -1 (no step): the header's step is never negative
        self._send_up(StageMessage("fail", session=self._session, step=max(self.worker.step, 0), peer=peer,
                                   code=code, reason=reason[:200]))

    def _put(self, priority: int, job: Callable[[], None], sender: str = "") -> None:
        """Queue ``job`` for the compute thread; ``sender``: whose frame it decodes (default: the session's
        latest upstream peer)."""
        self._jobs.put((priority, next(self._seq), job, sender))

    # --- compute thread ------------------------------------------------------------------------------------------

    def _compute_loop(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, job, sender = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            start = time.perf_counter()
            try:
                job()
            except ProtocolError as exc:  # a frame that decoded to something unusable: the sender's fault
                up = self._upstream
                self._on_bad(sender or (up.peer if up is not None else ""), str(exc))
            except StageStateError as exc:
                self.counters.stale += 1
                logger.debug("dropped a stale message: %s", exc)
            except Exception:
                logger.exception("a stage job failed")
            self.counters.busy_s += time.perf_counter() - start

    def _forward(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        if msg.op == "fwd":  # a micro-batch of a step whose trade completed here: the step is re-run
            self.trades.reopen(msg.session, msg.step)
        if msg.op == "fwd" and (msg.session, msg.step) != (self.worker.session, self.worker.step) and \
                self.trades.hold(lambda: self._forward(conn, msg, body)):
            return  # a mirror's step is not applied yet: the next one's micro-batches wait for it
        if msg.op == "fwd" and not self.trades.serves(msg.inner):  # the driver routes around this peer
            self.counters.fails_sent += 1
            self._send_up(StageMessage("fail", session=msg.session, step=msg.step, peer=self.peer_id,
                                       code=Reason.BAD_SHARE, reason="this peer missed a step of the phase"))
            return
        start = time.perf_counter()
        frame, window = split_body(body, self.vocab_size)
        received = self.codec.decode_forward(frame)
        shape = (received.tensor.shape[0], received.tensor.shape[1])
        if self.notary is not None and msg.op == "fwd":
            self.notary.observe(conn.peer, msg, received.tensor)
        if self.slot is not None and msg.op == "fwd":
            self.slot.served(msg.round)
        if msg.op == "eval":
            self.evals.run(conn, msg, received, window, shape)
            return
        new_step = (msg.session, msg.step) != (self.worker.session, self.worker.step)
        if self.gate is not None and new_step and not self.gate.enter(self.gate_timeout_s, msg.round):
            logger.warning("the round exchange took over %.0f s; serving the next step anyway", self.gate_timeout_s)
        self.worker.begin(msg.session, msg.step)
        if new_step:
            self.ends.started(msg)
        self.ledger.started(msg)
        if self.is_last:
            targets = decode_targets(window, shape, self.vocab_size)
            loss, grad = self.worker.loss_backward(msg.mb, msg.attempt, received.tensor, targets, msg.weight)
            assert grad is not None
            data = self.codec.encode_backward(grad, msg.mb)
            self.counters.forwards += 1
            self.counters.backwards += 1
            sumsq, count = self._norms(msg, 0.0)
            busy = time.perf_counter() - start
            conn.send(sealed(self.notary, StageMessage("bwd", session=msg.session, step=msg.step, mb=msg.mb,
                                                       attempt=msg.attempt, loss=min(loss, 1e6), busy=(busy,),
                                                       round=msg.round, inner=msg.inner, sumsq=sumsq,
                                                       count=count), data))
            return
        decode_targets(window, shape, self.vocab_size)  # check before passing it on
        out = self.worker.forward(msg.mb, msg.attempt, received.tensor)
        data = self.codec.encode_forward(out, received.token_ids, msg.mb)
        self.counters.forwards += 1
        nxt, rest = msg.route[0], msg.route[1:]
        with self._lock:
            self._pending[(msg.mb, msg.attempt)] = Pending(conn, nxt, time.perf_counter() - start)
        try:
            down = self.links.dial(nxt)
        except ConnectionError as exc:
            self._fail(nxt, Reason.UNREACHABLE, str(exc))
            return
        down.send(sealed(self.notary, replace(msg, route=rest), data + window))

    def _count_eval(self) -> None:
        self.counters.evals += 1

    def _pass_on(self, msg: StageMessage, received: Any, out: torch.Tensor, window: bytes,
                 unreachable: Callable[[ConnectionError], None]) -> None:
        """An evaluation's or a guard's output of this stage (no gradient, nothing kept) passed on down its route,
        unsealed (neither is training traffic an audit judges); ``unreachable`` is told when the next peer can't
        be dialled."""
        data = self.codec.encode_forward(out, received.token_ids, msg.mb)
        try:
            down = self.links.dial(msg.route[0])
        except ConnectionError as exc:
            unreachable(exc)
            return
        down.send(encode_message(replace(msg, route=msg.route[1:]), data + window))

    def _backward(self, sender: str, msg: StageMessage, body: bytes) -> None:
        start = time.perf_counter()
        if (msg.session, msg.step) != (self.worker.session, self.worker.step):
            raise StageStateError(f"backward of step {msg.step}, this stage is at step {self.worker.step}")
        saved = self.worker.saved.get(msg.mb)
        if saved is None or saved.attempt != msg.attempt:
            raise StageStateError(f"no forward of micro-batch {msg.mb} attempt {msg.attempt} is stored")
        shape = (saved.out.shape[0], saved.out.shape[1])
        grad = self.codec.decode_backward(body, shape).tensor
        if self.notary is not None:
            self.notary.observe(sender, msg, grad)
        grad_in = self.worker.backward(msg.mb, msg.attempt, grad)
        assert grad_in is not None
        data = self.codec.encode_backward(grad_in, msg.mb)
        self.counters.backwards += 1
        sumsq, count = self._norms(msg, self.ledger.below(msg))
        with self._lock:
            pending = self._pending.pop((msg.mb, msg.attempt), None)
        fwd_s = pending.fwd_s if pending is not None else 0.0
        busy = msg.busy + (fwd_s + time.perf_counter() - start,)
        up = pending.up if pending is not None else self._upstream
        if up is not None:
            up.send(sealed(self.notary, replace(msg, busy=busy[-32:], sumsq=sumsq, count=count), data))

    def busy_fraction(self) -> float:
        """Share of the time since the stage started that it spent computing."""
        return self.counters.busy_s / max(1e-9, time.perf_counter() - self.counters.started)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.links.close()
