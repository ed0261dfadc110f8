"""Scoring through a swarm's chain without training it: the driver's second concern beside its steps.

Two passes share the shape "stage 0 computes, the frame travels the chain, the last stage answers with a loss":
validation (``eval`` / ``loss``, at every stage's own weights) and the round's loss guard (``guard`` / ``gloss``, at
every stage's candidate result, :mod:`hlbp.peer.swarm.guardslot`). The driver chooses the chain and the labels; this
sends the frames on its links and reads the answers from its inbox, which no step is reading meanwhile (stage peers
never overlap a round with their phase).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.swarm.events import EventQueue, FailReport, GuardLoss, Loss, StreamClosed
from hlbp.peer.swarm.links import StageLinks
from hlbp.peer.swarm.worker import StageWorker
from hlbp.protocol.stagewire import Reason, StageMessage, encode_message, encode_tokens

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ChainBroke:
    """``peer`` of the chain failed while a pass was waiting for its answer, and no answer will come: the stream to
    the chain's first peer closed (it died, or dropped us), or a stage named a peer further down in a ``fail`` about
    this pass (the stream to it closed, or it could not be dialled: :mod:`hlbp.peer.swarm.evalrelay`). The driver
    bans it as it bans a peer that fails a step, so that its next step goes to another chain at once instead of
    finding the dead peer again."""

    peer: str


class ChainScorer:
    """Scores batches through a chain for the driver that owns ``links`` and ``inbox``."""

    def __init__(self, worker: StageWorker, codec: ActivationCodec, vocab_size: int, links: StageLinks,
                 inbox: EventQueue) -> None:
        self.worker, self.codec, self.vocab_size, self.links, self.inbox = worker, codec, vocab_size, links, inbox

    def evaluate(self, chain: Sequence[str], session: int, step: int, batches: Sequence[Batch],
                 timeout_s: float) -> float | ChainBroke | None:
        """Token-weighted mean loss over ``batches`` through ``chain``; :class:`ChainBroke` as soon as a peer of the
        chain is known to have failed (a peer that died mid-evaluation answers nothing: waiting out ``timeout_s``
        kept a driver from its steps and rounds for that long); None if no answer came in time or it could not be
        sent."""
        waiting: dict[int, int] = {}
        for i, (x, y) in enumerate(batches):
            out = self.worker.forward(i, 0, x, train=False)
            data = self.codec.encode_forward(out, x, i) + encode_tokens(x, y, self.vocab_size)
            msg = StageMessage("eval", session=session, step=step, mb=i, route=tuple(chain[1:]))
            try:
                self.links.dial(chain[0]).send(encode_message(msg, data))
            except ConnectionError:
                return None
            waiting[i] = int(y.numel())
        total, count = 0.0, 0
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            event = self.inbox.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            if isinstance(event, StreamClosed) and event.conn.peer == chain[0]:
                return ChainBroke(chain[0])
            if isinstance(event, FailReport) and event.belongs_to(session, step) and event.peer in chain:
                return ChainBroke(event.peer)
            if isinstance(event, Loss) and event.msg.session == session and event.msg.mb in waiting:
                n = waiting.pop(event.msg.mb)
                total += event.msg.loss * n
                count += n
        return total / count if not waiting and count else None

    def guard(self, chain: Sequence[str], session: int, step: int, r: int, params: Mapping[str, torch.Tensor],
              batch: Batch, timeout_s: float) -> float | ChainBroke | None:
        """The loss of the guard ``batch`` through ``chain`` with every stage at round ``r``'s candidate result (this
        stage's is ``params``); :class:`ChainBroke` when the chain's stream closes; None when a stage of the chain
        answers that it holds no candidate or that the chain broke below it, or when no answer came within
        ``timeout_s``."""
        x, y = batch
        out = self.worker.forward_at(params, x)
        data = self.codec.encode_forward(out, x, 0) + encode_tokens(x, y, self.vocab_size)
        msg = StageMessage("guard", session=session, step=step, round=r, route=tuple(chain[1:]))
        try:
            self.links.dial(chain[0]).send(encode_message(msg, data))
        except ConnectionError:
            return None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            event = self.inbox.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            if isinstance(event, StreamClosed) and event.conn.peer == chain[0]:
                return ChainBroke(chain[0])
            if isinstance(event, GuardLoss) and event.conn.peer == chain[0] and (event.msg.round, event.msg.mb) == (r, 0):
                return None if event.msg.code == Reason.UNSCORED else event.msg.loss
        return None
