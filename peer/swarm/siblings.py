"""A stage server's side of the trades with the other peers of its stage (the rules are in
:mod:`hlbp.peer.swarm.shares`).

When a step's micro-batches went through several peers of this stage, the driver's ``finish`` reaches one of them
(the first of the stage's serving peers by id) and names the others. That peer sends its part of the stage's
gradient to each of them (``share``); a peer that receives a share of a step it served sends its own part back to
every other, so each ends up with every part. Each adds them in peer-id order and takes the sum as the stage's
gradient of the step. The one the finish came through then passes the finish on with the sum's norm; when the
step's ``done`` comes back it applies the step and sends it to the others as an ``apply``, checked there against the
sum's norm each of them computed. Those others apply it as mirrors: their weights follow, their round gate does not
count the step, so the stage's round contribution comes from one peer (:meth:`SiblingTrades.counts`).

Before adding, each peer compares the lineages the shares carry with its own (what its AdamW moments have seen). If
any differ, every peer of the trade sees the same difference, clears its moments and starts the same new lineage,
so their updates stay equal.

Everything runs on the server's compute thread except :meth:`expire`, which only queues a job there. A trade whose
shares do not all come within ``timeout_s`` makes the finish's peer send a ``fail`` naming a missing peer; the
driver re-runs the step without it. A peer where that trade did complete holds the sum; a micro-batch of the step,
or a share of it from the lowest id of the trade (the re-run's leader), reaching it again means the step is re-run,
and it takes back its own part first (:meth:`SiblingTrades.reopen`). Another peer's share of such a step waits for
the leader's: alone, it may be a resent share of the completed trade, which must not undo that trade here.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hlbp.peer.swarm.shares import Trade, joint_lineage, sumsq_of
from hlbp.peer.swarm.worker import OwnPart, StageStateError, StageWorker, done_fault, finish_fault
from hlbp.protocol.gradshare import Share, decode_share, encode_share
from hlbp.protocol.stagewire import Reason, StageMessage, encode_message

logger = logging.getLogger(__name__)


@dataclass
class Settled:
    """A trade that completed here: the stage's gradient of the step is the sum of every part."""

    peers: tuple[str, ...]  # every peer that served the stage in the step, sorted
    sumsq: float  # the squared norm of the sum (what an apply must agree with)
    led: bool  # the finish came through this peer: it sends the step's apply to the others
    applied: bool = False  # the step was applied (or skipped) here
    own: OwnPart | None = None  # this peer's part before the sum replaced it, until the step is applied


class SiblingTrades:
    """Trades of one stage server (see the module docstring). ``links`` sends, ``put(job)`` queues a job on the
    compute thread, ``fail(peer, code, reason)`` tells the driver a peer failed, ``on_bad(peer, error)`` bans a
    peer whose share broke the rules."""

    def __init__(self, worker: StageWorker, links: Any, me: str, put: Callable[[Callable[[], None]], None],
                 fail: Callable[[str, Reason, str], None], on_bad: Callable[[str, str], None],
                 timeout_s: float = 20.0, requeue: Callable[[Callable[[], None]], None] | None = None,
                 phase_start: Callable[[], bool] = lambda: True) -> None:
        self.worker, self.links, self.me = worker, links, me
        self.phase_start = phase_start  # whether the step under way is its phase's first
        self.put, self.fail, self.on_bad = put, fail, on_bad
        self.requeue = requeue or put  # where held forwards go back to
        self.timeout_s = timeout_s
        self.shapes = worker.shapes()
        self._key: tuple[int, int, tuple[str, ...]] | None = None  # (session, step, serving peers) of the trade
        self._trade: Trade | None = None
        self._then: Callable[[], None] | None = None  # what the finish does once the trade completes
        self._lineages: dict[str, bytes] = {}
        self.settled: dict[tuple[int, int], Settled] = {}  # the step's trade that completed here (the last one)
        self._held: list[Callable[[], None]] = []  # the next step's forwards, held until a mirror applied its step
        # this peer missed a step of the phase under way (it refused its leader's share, or the leader's apply did
        # not come): its weights are not the stage's, so it serves no training step until the next phase
        self.missed = False
        self.last_sumsq = 0.0  # the stage's whole gradient of the last trade that completed here (a share's bound)
        self.traded = 0  # trades completed
        self.refused = 0  # shares refused
        # shares of a step whose trade completed here, from peers other than a re-run's leader, held for that
        # leader's share (one per sender; dropped when the step is applied)
        self._early: dict[str, tuple[StageMessage, tuple[str, ...], Share]] = {}
        self.deferred = 0  # shares held for a re-run's leader

    # --- compute thread --------------------------------------------------------------------------------------------

    def lead(self, msg: StageMessage, others: tuple[str, ...], then: Callable[[], None]) -> None:
        """The finish of step (msg.session, msg.step) reached this peer and names ``others`` beside it: trade, and
        run ``then`` (the finish goes on) once every part is here."""
        peers = tuple(sorted({self.me, *others}))
        self._begin(msg.session, msg.step, msg.count, peers)
        self._then = then
        self._send_share(led=True)
        self._settle_if_complete()
        timer = threading.Timer(self.timeout_s, lambda: self.put(lambda: self._expire(msg.session, msg.step, peers)))
        timer.daemon = True
        timer.start()

    def received(self, sender: str, msg: StageMessage, body: bytes) -> None:
        """A share of ``sender``; the first of a step this peer served makes it send its own part to the others."""
        if (msg.session, msg.step) != (self.worker.session, self.worker.step):
            raise StageStateError(f"a share of step {msg.step}, this stage is at step {self.worker.step}")
        peers = tuple(sorted(msg.peers))
        if self.me not in peers or sender not in peers or len(set(peers)) != len(peers) or len(peers) < 2:
            self._refuse(sender, f"a share naming peers {[p[:12] for p in peers]}, not both of us")
            return
        share = decode_share(body, msg.count, self.shapes)  # a ProtocolError bans the sender (the compute loop)
        key = (msg.session, msg.step)
        if self._open(key) and sender != peers[0]:
            # a share of a step whose trade completed here: a re-run's trade starts with its leader's share (the
            # lowest id), so until that comes this one waits; a peer resending its share of the completed trade
            # would otherwise make this one take its part back and refuse the leader's apply
            self._early[sender] = (msg, peers, share)
            self.deferred += 1
            return
        self.reopen(msg.session, msg.step)  # the leader trades a step already traded here: it is being re-run
        self._take(sender, msg, peers, share)
        early = [(p, *held) for p, held in self._early.items() if (held[0].session, held[0].step) == key]
        self._early = {}
        for p, m, named, s in early:  # the re-run's shares that came before its leader's
            self._take(p, m, named, s)

    def _open(self, key: tuple[int, int]) -> bool:
        """Whether step ``key``'s trade completed here and the step is not applied yet (a re-run would reopen it)."""
        settled = self.settled.get(key)
        return settled is not None and not settled.applied and settled.own is not None

    def _take(self, sender: str, msg: StageMessage, peers: tuple[str, ...], share: Share) -> None:
        """Add ``sender``'s checked share to the trade of (msg.session, msg.step, peers), begun here if it is not."""
        if self._key != (msg.session, msg.step, peers):
            self._begin(msg.session, msg.step, msg.count, peers)
            self._send_share(led=False)
        if self._trade is None:  # a share of a trade that completed or was refused here: nothing to add it to
            return
        fault = self._trade.fault(sender, share, self.worker.sumsq(), self.last_sumsq)
        if fault is not None:
            self._refuse(sender, fault)
            return
        self._lineages[sender] = msg.lineage
        self._settle_if_complete()

    def apply_fault(self, sender: str, msg: StageMessage) -> str | None:
        """Why the ``apply`` a peer of this stage sent must not be applied here as a mirror, or None."""
        settled = self.settled.get((msg.session, msg.step))
        if settled is None or sender not in settled.peers or settled.led:
            return f"an apply of step {msg.step}, whose trade with {sender[:12]} did not complete here"
        fault = finish_fault(msg.lr, msg.opt_step, msg.max_norm, self.worker.optim)
        if fault is not None:
            return fault
        return done_fault(msg.lr, msg.scale, msg.sumsq, msg.lr, msg.max_norm, settled.sumsq)

    def pass_apply(self, msg: StageMessage) -> None:
        """This peer applied a step it led the trade of: the others apply it too."""
        settled = self.settled.get((msg.session, msg.step))
        if settled is None or not settled.led:
            return
        out = encode_message(StageMessage("apply", session=msg.session, step=msg.step, opt_step=msg.opt_step,
                                          lr=msg.lr, max_norm=self.worker.optim.grad_clip, sumsq=msg.sumsq,
                                          scale=msg.scale, tokens=msg.tokens, round_end=msg.round_end))
        for peer in settled.peers:
            if peer != self.me:
                try:
                    self.links.dial(peer).send(out)
                except ConnectionError as exc:  # that peer falls behind; the next phase joins it again
                    logger.warning("the apply of step %d could not reach %s: %s", msg.step, peer[:12], exc)

    def hold(self, job: Callable[[], None]) -> bool:
        """Hold ``job`` (a forward of a later step) while this peer, a mirror, has not yet applied the step under way:
        the leader's apply comes on another stream than the next step's micro-batches and may come after them, and
        starting the next step first would drop this one's gradient. Returns whether it was held; held forwards go
        back to the queue when the step is applied, or after ``timeout_s`` (this peer then falls behind)."""
        settled = self.settled.get((self.worker.session, self.worker.step))
        if settled is None or settled.led or settled.applied:
            return False
        if not self._held:
            key = (self.worker.session, self.worker.step)
            timer = threading.Timer(self.timeout_s, lambda: self.put(lambda: self._release(key)))
            timer.daemon = True
            timer.start()
        self._held.append(job)
        return True

    def applied(self, session: int, step: int) -> None:
        """Step (``session``, ``step``) was applied or skipped here: forwards held for it go back to the queue."""
        settled = self.settled.get((session, step))
        if settled is not None:
            settled.applied, settled.own = True, None
        self._early = {}
        self._release((session, step))

    def reopen(self, session: int, step: int) -> bool:
        """A forward or a share of a step whose trade completed here and was not applied: the driver re-runs the
        step (a peer of the trade or a later stage failed), so this peer takes its own part back from the sum. The
        re-run then adds the micro-batches it is given now to that part, and the next trade gets the part alone:
        kept, the sum would count every other peer's micro-batches as this peer's, and the trade's partners would
        refuse it as overlapping theirs. Returns whether it did."""
        if not self._open((session, step)):
            return False
        settled = self.settled[(session, step)]
        logger.info("step %d is re-run after its trade with %s: taking back this peer's part", step,
                    ", ".join(p[:12] for p in settled.peers if p != self.me))
        self.worker.restore_part(settled.own)
        del self.settled[(session, step)]
        self._key, self._trade, self._then = None, None, None
        return True

    def _release(self, key: tuple[int, int]) -> None:
        settled = self.settled.get(key)
        if settled is not None and not settled.applied:
            logger.warning("step %d: no apply from the peer that led its trade within %.0f s; serving no more steps "
                           "of this phase", key[1], self.timeout_s)
            settled.applied, settled.own = True, None
            self.missed = True
        held, self._held = self._held, []
        for job in held:
            self.requeue(job)

    def peers_of(self, session: int, step: int) -> tuple[str, ...]:
        """The peers that served this stage in the step (this peer alone unless a trade completed)."""
        settled = self.settled.get((session, step))
        return settled.peers if settled is not None else (self.me,)

    # --- inside ----------------------------------------------------------------------------------------------------

    def _begin(self, session: int, step: int, count: int, peers: tuple[str, ...]) -> None:
        own = frozenset(self.worker.accumulated)
        self._key = (session, step, peers)
        self._trade = Trade(self.me, count, own, frozenset(peers) - {self.me})
        self._then = None
        self._lineages = {}
        self.settled = {k: v for k, v in self.settled.items() if k[0] == session and k[1] >= step - 1}

    def _send_share(self, led: bool) -> None:
        assert self._key is not None and self._trade is not None
        session, step, peers = self._key
        grads = self.worker.gradients()
        finite = all(bool(g.isfinite().all()) for g in grads.values())
        if not self._trade.own:
            raise StageStateError(f"a trade of step {step}, and no micro-batch of it accumulated here")
        body = encode_share(self._trade.own, self._trade.count, grads if finite else None)
        self._trade.not_finite |= not finite
        out = encode_message(StageMessage("share", session=session, step=step, count=self._trade.count,
                                          peers=peers, lineage=self.worker.lineage), body)
        for peer in peers:
            if peer == self.me:
                continue
            try:
                self.links.dial(peer).send(out)
            except ConnectionError as exc:
                logger.warning("the share of step %d could not reach %s: %s", step, peer[:12], exc)
                if led:
                    self.fail(peer, Reason.UNREACHABLE, str(exc))

    def _settle_if_complete(self) -> None:
        trade, key = self._trade, self._key
        if trade is None or key is None or not trade.complete():
            return
        session, step, peers = key
        differ = sorted(p for p, lineage in self._lineages.items() if lineage != self.worker.lineage)
        if differ and not self.phase_start():
            # within a phase the peers of a stage applied the same steps from the same round's result, so a lineage
            # that differs means a peer missed a step: its weights differ too, and adding its part would mix them.
            # The step is re-run without it (the one that leads names it; this phase it serves no more)
            logger.warning("step %d: stage peer %s missed a step of this phase; not trading with it", step,
                           differ[0][:12])
            led, self._trade, self._then = self._then is not None, None, None
            if led:
                self.fail(differ[0], Reason.BAD_SHARE, f"its optimizer state left ours in step {step}'s phase")
            else:
                self.missed = True
            return
        if differ:
            logger.info("step %d: the optimizer states of stage peers %s differ; each clears its moments", step,
                        ", ".join(p[:12] for p in peers))
            self.worker.forget_moments(joint_lineage(session, step, peers))
        total = trade.total(self.worker.gradients())
        if total is None:  # a part was not finite: the step is skipped everywhere, as a non-finite norm skips it
            total = {n: torch.full(shape, float("nan")) for n, shape in self.shapes.items()}
        own = self.worker.own_part()
        self.worker.take_gradients(total, trade.count)
        led = self._then is not None
        self.settled[(session, step)] = Settled(peers, sumsq_of(total), led, own=own)
        if math.isfinite(self.settled[(session, step)].sumsq):
            self.last_sumsq = self.settled[(session, step)].sumsq
        self.traded += 1
        then, self._trade, self._then = self._then, None, None
        if then is not None:
            then()

    def _expire(self, session: int, step: int, peers: tuple[str, ...]) -> None:
        if self._key != (session, step, peers) or self._trade is None or self._then is None:
            return  # completed, or superseded
        missing = self._trade.missing()
        who = missing[0] if missing else peers[0]
        self._trade, self._then = None, None
        self.fail(who, Reason.NO_SHARE, f"no share of step {step} within {self.timeout_s:.0f} s")

    def _refuse(self, sender: str, fault: str) -> None:
        self.refused += 1
        self.on_bad(sender, fault)
        if self._then is not None:  # the finish waits here: the driver re-runs the step without that peer
            self._trade, self._then = None, None
            self.fail(sender, Reason.BAD_SHARE, fault)
        elif self._trade is not None:  # a mirror: the step goes on without it, so its weights fall behind
            self._trade = None
            self.missed = True

    def serves(self, inner: int) -> bool:
        """Whether this peer may serve a training step whose phase applied ``inner`` steps before it: not after it
        missed a step of the phase (a phase's first step starts every peer from the round's result again)."""
        if inner == 0:
            self.missed = False
        return not self.missed


def without_own(msg: StageMessage) -> StageMessage:
    """The finish as it goes on after this stage: the peers beside this stage's are dropped from its lists."""
    if not msg.per:
        return msg
    return replace(msg, peers=msg.peers[msg.per[0]:], per=msg.per[1:])
