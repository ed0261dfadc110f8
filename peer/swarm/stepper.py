"""How a swarm's driver runs one inner step through a chain of stage peers, from its micro-batches to its update.

One inner step: the batch is split into ``micro_batches`` micro-batches (each one's loss weighted by its share of
the tokens, so the step's gradient is the whole batch's); up to ``in_flight`` of them travel the chain at once.
The last backward through each stage brings up the squared gradient norms of that stage and every later one, so
when every micro-batch has come back the driver knows the global norm: it steps its own AdamW with the clipping
factor and sends ``apply`` down the chain in front of the next step's micro-batches, and each stage steps on it.
No message waits for a round trip between two steps. Where the norms did not come up complete (micro-batches
re-run through another chain), ``finish`` collects them down the chain, the last stage turns them into the factor,
and ``done`` brings it back up. Either way the update equals a full replica's on the same batch (a test checks it
with a lossless codec).

Failures never lose a micro-batch silently:

- a ``fail`` from a stage (its downstream stream closed, a peer could not be dialled), a closed stream to stage 1,
  or a micro-batch past its deadline (3x the recent p95 round trip, bounded; then every peer of the chain is
  pinged and the silent ones are failed) bans the failed peer with backoff and picks another chain;
- every micro-batch of the step that went through the old chain is re-run through the new one (stages that
  already accumulated it only pass the gradient back, see :mod:`hlbp.peer.swarm.worker`) and counted in
  ``microbatches_retried``;
- when no working chain appears within ``chain_wait_s``, or a micro-batch fails ``max_attempts`` times, the step is
  abandoned: every stage drops its state for it, and ``steps_abandoned`` and ``microbatches_abandoned`` count it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.swarm.chains import Chains
from hlbp.peer.swarm.events import (
    Backward,
    BadPeer,
    Done,
    Event,
    EventQueue,
    FailReport,
    StreamClosed,
)
from hlbp.peer.swarm.links import StageLinks
from hlbp.peer.swarm.routing import LatencyTracker
from hlbp.peer.swarm.step import (
    Abandon,
    MicroBatch,
    PeerFailed,
    Schedule,
    StepAbandoned,
    StepResult,
    StepState,
    micro_batches,
)
from hlbp.peer.swarm.transcript import Notary, sealed
from hlbp.peer.swarm.worker import StageWorker, done_fault, wire_norm, wire_scale
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import Reason, StageMessage, encode_message, encode_tokens

logger = logging.getLogger(__name__)


@dataclass
class DriverConfig:
    """How the driver runs its swarm; per peer, not per run."""

    micro_batches: int = 8  # micro-batches per inner step (the step's batch is split into this many)
    schedule: Schedule = Schedule.UNIFORM  # how the batch is cut (step.micro_batch_rows)
    in_flight: int | None = None  # most micro-batches in the chain at once; None: all of the step's
    max_norm: float = 1.0  # global gradient clipping (0: none)
    deadline_s: float | None = None  # fixed per-micro-batch deadline; None: 3x the recent p95 round trip, bounded
    min_deadline_s: float = 5.0
    max_deadline_s: float = 120.0
    max_attempts: int = 4  # a micro-batch that fails this often abandons its step
    chain_wait_s: float = 60.0  # how long a step waits for a complete chain before it is abandoned
    ping_timeout_s: float = 3.0
    # at a phase's first step, a stage's peer gives way to one at least this many times faster (measured, else
    # announced; routing.choose_chain); 0: a peer keeps its stage until it fails
    switch_factor: float = 2.0
    # most peers serving one stage in a step (they trade gradients at its end, hlbp.peer.swarm.siblings); 1: one
    stage_peers: int = 1
    share_wait_s: float = 30.0  # what a shared stage's trade may add to the finish's deadline


@dataclass
class DriverCounters:
    """Every micro-batch is accounted for: done once per step, retried, or abandoned with its step."""

    steps: int = 0
    steps_abandoned: int = 0
    steps_skipped: int = 0  # non-finite gradient norm: no stage stepped
    norm_round_trips: int = 0  # completed steps whose norms needed a finish and done (not brought up by backward)
    microbatches: int = 0  # micro-batches that finished backward in a completed step
    microbatches_retried: int = 0
    microbatches_abandoned: int = 0
    failures: int = 0  # stage peers failed and banned
    tokens: int = 0  # training tokens of completed steps
    busy_s: dict[str, float] = field(default_factory=dict)  # compute seconds per stage peer (driver: "driver")


class StepRunner:
    """The driver's inner steps: each one's micro-batches sent through a chain (``chains`` picks it), the answers
    taken from ``inbox`` (the driver's links put them there), deadlines, re-runs through another chain, and the
    update. ``seq`` numbers the steps of this driver's ``session``; ``stepped_round`` is the outer round of the last
    step a chain finished. ``on_bad(peer, error)`` reports a peer whose bytes did not decode."""

    def __init__(self, worker: StageWorker, codec: ActivationCodec, vocab_size: int, cfg: DriverConfig,
                 chains: Chains, links: StageLinks, inbox: EventQueue, session: int,
                 on_bad: Callable[[str, str], None], stop: Any = None, notary: Notary | None = None) -> None:
        self.worker, self.codec, self.vocab_size, self.cfg = worker, codec, vocab_size, cfg
        self.chains, self.links, self.inbox, self.session = chains, links, inbox, session
        self.on_bad, self.stop, self.notary = on_bad, stop, notary
        self.peer_id = links.peer_id
        self.seq = 0
        self.stepped_round = -1
        self.latency = LatencyTracker(override_s=cfg.deadline_s, min_s=cfg.min_deadline_s, max_s=cfg.max_deadline_s)
        self.counters = DriverCounters()
        self._routes: list[list[str]] = []  # the distinct routes of the step under way (where an abort goes)

    def ping(self, peers: Sequence[str], round_: int = 0) -> tuple[list[str], list[str]]:
        """The peers of ``peers`` that do not answer a ping in time, and those that answer that they are
        exchanging an outer round (or behind ``round_``)."""
        for peer in peers:
            try:
                self.links.dial(peer, self.cfg.ping_timeout_s).send(
                    encode_message(StageMessage("ping", session=self.session, round=round_)))
            except ConnectionError:
                continue
        answered, exchanging = self.inbox.pongs(len(peers), self.cfg.ping_timeout_s)
        return [p for p in peers if p not in answered], [p for p in peers if p in exchanging]

    def _send(self, i: int, step: StepState) -> None:
        mb, chain = step.mbs[i], step.route(i)
        mb.attempt += 1
        mb.done = False
        out = self.worker.forward(i, mb.attempt, mb.x)
        data = self.codec.encode_forward(out, mb.x, i) + encode_tokens(mb.x, mb.y, self.vocab_size)
        msg = StageMessage("fwd", session=self.session, step=self.seq, mb=i, attempt=mb.attempt,
                           route=tuple(chain[1:]), weight=mb.weight, round=step.round, inner=step.inner,
                           count=len(step.mbs))
        mb.sent_at = time.monotonic()
        self.links.dial(chain[0]).send(sealed(self.notary, msg, data))

    def _abandon(self, step_mbs: list[MicroBatch], cause: Abandon, reason: str) -> StepAbandoned:
        self.counters.steps_abandoned += 1
        self.counters.microbatches_abandoned += len(step_mbs)
        self.worker.reset()
        routes = self._routes or ([self.chains.chain] if self.chains.chain else [])
        for route in routes:
            try:
                self.links.dial(route[0], 3).send(encode_message(StageMessage(
                    "abort", session=self.session, step=self.seq, route=tuple(route[1:]), reason=reason[:200])))
            except ConnectionError:
                pass
        logger.warning("step %d abandoned (%d micro-batches): %s", self.seq, len(step_mbs), reason)
        return StepAbandoned(cause, reason)

    def run(self, x: torch.Tensor, y: torch.Tensor, opt_step: int, lr: float,
                   round_end: bool = False, give_up: Callable[[], bool] | None = None, round_r: int = 0,
                   inner: int = 0) -> StepResult:
        """One inner step on the batch (x, y) [batch, seq]; raises :class:`StepAbandoned` if it can't finish.

        ``round_end`` marks the swarm's last inner step of an outer round: every stage of the chain then stops
        starting steps and contributes its shard's pseudo-gradient (hlbp.peer.swarm.gate). ``round_r`` and ``inner``
        label every frame of the step (the outer round, and the steps applied in its phase before this one), so an
        audit knows which weights computed it (hlbp.peer.swarm.audit). ``give_up()`` is asked
        while the step waits for a chain (every half second): True abandons the step at once (the outer round it
        belongs to has closed without the swarm, so waiting longer only puts the swarm further behind).

        Each turn sends what the window allows, then handles one event (or a deadline); a handler returns the
        step's result, :class:`PeerFailed` (the step then moves to another chain), or None to go on."""
        start = time.perf_counter()
        self.seq += 1
        mbs = micro_batches(x, y, self.cfg.micro_batches, self.cfg.schedule)
        tokens = [m.y.numel() for m in mbs]
        self._routes = []
        # a phase's first step may hand a stage to a faster peer, or to several: a standby holds the round's result,
        # so the switch costs that stage its AdamW moments only, not steps of the phase
        serving = self.chains.pick(tokens, give_up, self.peer_id, self.cfg.stage_peers, inner == 0,
                                   self.cfg.switch_factor)
        if serving is None:
            raise self._abandon(mbs, Abandon.NO_CHAIN, "no complete chain of stage peers")
        self.worker.begin(self.session, self.seq)
        window = min(len(mbs), self.cfg.in_flight or len(mbs))
        step = StepState(mbs, [stage[0] for stage in serving], window, opt_step, lr, int(y.numel()), round_end,
                         give_up, start, round_r, inner, serving=serving, routes=self.chains.routes(serving, tokens))
        self._routes = _distinct(step.routes)
        while True:
            if self.stop is not None and self.stop.is_set():
                raise self._abandon(mbs, Abandon.STOPPING, "this peer is stopping")
            outcome = self._send_more(step)
            if outcome is None:
                outcome = self._next(step)
            if isinstance(outcome, StepResult):
                return outcome
            if isinstance(outcome, PeerFailed):
                self._reroute(step, outcome.peer)

    def _send_more(self, step: StepState) -> StepResult | PeerFailed | None:
        """Send micro-batches up to the window; once all are done, the step's apply (the norms came up complete:
        the step's result) or its finish; the first stage's peer if it could not be dialled."""
        if step.finishing:
            return None
        inflight = step.inflight()
        for i in step.unsent():
            if len(inflight) >= step.window:
                break
            try:
                self._send(i, step)
            except ConnectionError as exc:  # stage 1 cannot be dialled: it failed
                logger.warning("%s", exc)
                step.mbs[i].sent_at = 0.0
                return PeerFailed(step.route(i)[0])
            inflight.append(i)
        if all(m.done for m in step.mbs):
            if step.below is not None and not step.shared():
                return self._apply_down(step, step.below)
            step.finishing = True
            step.finish_at = time.monotonic()
            self._send_finish(step)
        return None

    def _apply_down(self, step: StepState, below: float) -> StepResult | PeerFailed:
        """Every micro-batch is back and the later stages' norms came with them: send the step's ``apply`` down
        the chain (ahead of the next step's micro-batches on the same stream) and step here."""
        total = wire_norm(below + min(self.worker.sumsq(), 1e300))
        scale = wire_scale(total, self.cfg.max_norm)
        msg = StageMessage("apply", session=self.session, step=self.seq, opt_step=step.opt_step, lr=step.lr,
                           max_norm=self.cfg.max_norm, sumsq=total, scale=scale, tokens=step.tokens,
                           round_end=step.round_end, route=tuple(step.chain[1:]))
        try:
            self.links.dial(step.chain[0]).send(encode_message(msg))
        except ConnectionError as exc:  # nothing was stepped: the step runs again on another chain
            logger.warning("%s", exc)
            return PeerFailed(step.chain[0])
        return self._stepped(step, scale)

    def _next(self, step: StepState) -> StepResult | PeerFailed | None:
        """Wait for the next event, at most until the oldest micro-batch (or the finish) is past its deadline,
        and handle it."""
        inflight = step.inflight()
        deadline = self.latency.deadline() + (self.cfg.share_wait_s if step.finishing and step.shared() else 0.0)
        oldest = step.oldest_sent()
        wait = 1.0 if oldest is None else max(0.0, oldest + deadline - time.monotonic())
        event = self.inbox.get(timeout=min(wait, 1.0))
        if event is None:
            if oldest is not None and time.monotonic() > oldest + deadline:
                return self._on_deadline(step, inflight, deadline)
            return None
        return self._handle(step, event, inflight)

    def _handle(self, step: StepState, event: Event, inflight: list[int]) -> StepResult | PeerFailed | None:
        """Dispatch one event of the step to its handler; answers to another step or session are dropped."""
        if isinstance(event, StreamClosed):
            return self._on_stream_closed(step, event, inflight)
        if isinstance(event, BadPeer):
            return self._on_bad_peer(step, event)
        if isinstance(event, FailReport) and event.code == Reason.BAD_DONE and event.peer in step.peers() \
                and event.belongs_to(self.session, self.seq - 1):
            return PeerFailed(event.peer)  # the previous step's apply was refused below a peer that altered it
        if not event.belongs_to(self.session, self.seq):
            return None  # a late answer to an older step or session
        if isinstance(event, Backward):
            self._on_backward(step, event)
        elif isinstance(event, Done) and step.finishing:
            return self._on_done(step, event)
        elif isinstance(event, FailReport):
            return self._on_failed(step, event)
        return None  # a pong or loss outside a ping or an evaluation, or a done before the finish: nothing to do

    def _on_stream_closed(self, step: StepState, event: StreamClosed, inflight: list[int]) -> PeerFailed | None:
        """The stream to stage 1 closed while the step needs it: that peer failed."""
        closed = event.conn.peer
        waiting = step.finishing and closed == step.chain[0]
        return PeerFailed(closed) if waiting or any(step.route(i)[0] == closed for i in inflight) else None

    def _on_bad_peer(self, step: StepState, event: BadPeer) -> PeerFailed | None:
        """A peer sent bytes that did not decode: banned; if it is in the chain, it failed."""
        self.chains.fail(event.peer)
        return PeerFailed(event.peer) if event.peer in step.peers() else None

    def _on_deadline(self, step: StepState, inflight: list[int], deadline: float) -> PeerFailed | None:
        """The oldest micro-batch (or the finish) is past its deadline: ping the chain. A silent peer failed; a
        peer at its round gate gets a new deadline a few times; if everyone answers, the micro-batches were lost
        and go again."""
        silent, exchanging = self.ping(step.peers(), step.round)
        if silent:
            return PeerFailed(silent[0])
        if exchanging and step.waits < self.cfg.max_attempts:
            step.waits += 1  # waiting at a stage's round gate, not lost: a new deadline, a few times
            for i in inflight:
                step.mbs[i].sent_at = time.monotonic()
            step.finish_at = time.monotonic()
            return None
        if exchanging:
            return PeerFailed(exchanging[0])  # says it is exchanging past every renewed deadline: treat it as failed
        stale = [i for i in inflight if not step.mbs[i].done]
        if step.finishing or any(step.mbs[i].attempt + 1 >= self.cfg.max_attempts for i in stale):
            raise self._abandon(step.mbs, Abandon.DEADLINE, f"micro-batches past their {deadline:.1f} s deadline, "
                                "and every stage peer answers")
        for i in stale:
            step.mbs[i].sent_at = 0.0
        step.retried += len(stale)
        self.counters.microbatches_retried += len(stale)
        logger.warning("%d micro-batches past their %.1f s deadline; sending them again", len(stale), deadline)
        return None

    def _on_backward(self, step: StepState, event: Backward) -> None:
        """A micro-batch's gradient came back: backward through stage 0; stale attempts are dropped."""
        msg = event.msg
        m = step.mbs[msg.mb] if msg.mb < len(step.mbs) else None
        if m is None or m.done or msg.attempt != m.attempt:
            return
        try:
            grad = self.codec.decode_backward(event.body, (m.x.shape[0], m.x.shape[1])).tensor
        except ProtocolError as exc:
            self.on_bad(event.conn.peer, str(exc))
            return
        if self.notary is not None:
            self.notary.observe(event.conn.peer, msg, grad)
        t0 = time.perf_counter()
        self.worker.backward(msg.mb, msg.attempt, grad)
        m.done, m.loss = True, msg.loss
        step.below = msg.sumsq if msg.count == len(step.mbs) else None  # the newest backward's word counts
        self.latency.add(time.monotonic() - m.sent_at)
        self._account(step.route(msg.mb), msg.busy, m.y.numel(), time.perf_counter() - t0)

    def _on_done(self, step: StepState, event: Done) -> StepResult | PeerFailed:
        """The chain finished the step: apply it here too (or skip it everywhere, non-finite) and count it."""
        msg = event.msg
        fault = done_fault(msg.lr, msg.scale, msg.sumsq, step.lr, self.cfg.max_norm,
                           min(self.worker.sumsq(), 1e300))
        if fault is not None:  # never stepped as its sender chose: it failed (banned), the step runs on another chain
            logger.warning("stage peer %s sent a done that does not add up: %s", event.conn.peer[:12], fault)
            return PeerFailed(event.conn.peer)
        self.latency.add((time.monotonic() - step.finish_at) / 2)
        if step.shared():  # what sharing a stage costs a step: weighed at the next phase's first step
            self.chains.shared_end(time.monotonic() - step.finish_at)
        self.counters.norm_round_trips += 1
        return self._stepped(step, msg.scale)

    def _stepped(self, step: StepState, scale: float) -> StepResult:
        """Step here at the step's rate with clipping factor ``scale`` (or skip it: non-finite) and count it."""
        ok = scale > 0 and self.worker.apply(step.lr, scale)
        if not ok:
            self.worker.reset()
            self.counters.steps_skipped += 1
        self.counters.steps += 1
        self.counters.microbatches += len(step.mbs)
        self.counters.tokens += step.tokens
        self.chains.served(step.peers())
        self.stepped_round = step.round  # the round whose guard this chain will score (guard_loss)
        return StepResult(step.loss(), time.perf_counter() - step.started, list(step.chain), step.retried,
                          [list(stage) for stage in step.serving])

    def _on_failed(self, step: StepState, event: FailReport) -> PeerFailed:
        """A stage named a failed peer; one that already applied the step abandons it (re-running cannot help)."""
        if event.code == Reason.ALREADY_APPLIED:
            raise self._abandon(step.mbs, Abandon.ALREADY_APPLIED, f"{event.peer[:12]}… {event.msg.reason}")
        return PeerFailed(event.peer)

    def failed(self, peer: str) -> None:
        """``peer`` failed: counted, and banned from this driver's chains for a backoff."""
        self.counters.failures += 1
        seconds = self.chains.fail(peer)
        logger.warning("stage peer %s failed; banned for %.0f s", peer[:12], seconds)

    def _reroute(self, step: StepState, failed: str) -> None:
        """A stage peer failed: ban it, choose another chain, re-run what went through the old one."""
        self.failed(failed)
        if failed == self.peer_id:
            raise self._abandon(step.mbs, Abandon.NAMED_AS_FAILED, "this driver was named as failed")
        tokens = [m.y.numel() for m in step.mbs]
        serving = self.chains.pick(tokens, step.give_up, self.peer_id, self.cfg.stage_peers)
        if serving is None:
            raise self._abandon(step.mbs, Abandon.NO_REPLACEMENT, f"no stage peer can replace {failed[:12]}…")
        sent = [m for m in step.mbs if m.attempt >= 0]
        if any(m.attempt + 1 >= self.cfg.max_attempts for m in sent):
            raise self._abandon(step.mbs, Abandon.TOO_MANY_ATTEMPTS,
                                f"a micro-batch failed {self.cfg.max_attempts} times")
        for m in sent:
            m.done, m.sent_at = False, 0.0
        # a micro-batch stays with a peer that accumulated it and still serves (a trade must count it once)
        step.routes = self.chains.routes(serving, tokens, step.routes)
        step.serving, step.chain = serving, [stage[0] for stage in serving]
        self._routes = _distinct(step.routes)
        chain = step.chain
        step.retried += len(sent)
        self.counters.microbatches_retried += len(sent)
        step.finishing = False
        logger.warning("re-running %d micro-batches of step %d through %s", len(sent), self.seq,
                       " -> ".join(p[:12] for p in chain))

    def _send_finish(self, step: StepState) -> None:
        """The step's finish down its chain; where several peers served a stage it names the others beside the
        chain's, which trade gradients with it first (hlbp.peer.swarm.siblings)."""
        chain = step.chain
        per = tuple(len(stage) - 1 for stage in step.serving) if step.shared() else ()
        peers = tuple(p for stage in step.serving for p in stage[1:]) if per else ()
        msg = StageMessage("finish", session=self.session, step=self.seq, count=len(step.mbs),
                           opt_step=step.opt_step, lr=step.lr, max_norm=self.cfg.max_norm,
                           sumsq=min(self.worker.sumsq(), 1e300), route=tuple(chain[1:]), tokens=step.tokens,
                           round_end=step.round_end, peers=peers, per=per)
        try:
            self.links.dial(chain[0]).send(encode_message(msg))
        except ConnectionError:
            pass  # the deadline finds the silent peer

    def _account(self, chain: list[str], busy: Sequence[float], tokens: int, own_s: float) -> None:
        b = self.counters.busy_s
        b["driver"] = b.get("driver", 0.0) + own_s
        for peer, seconds in zip(reversed(chain), busy):
            b[peer] = b.get(peer, 0.0) + seconds
            if seconds > 0:
                self.chains.measure(peer, tokens / seconds)


def _distinct(routes: Sequence[Sequence[str]]) -> list[list[str]]:
    """The distinct routes among ``routes``, in first-seen order."""
    out: list[list[str]] = []
    for route in routes:
        if list(route) not in out:
            out.append(list(route))
    return out
