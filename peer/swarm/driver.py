"""The driver of a pipeline swarm: stage 0, its links to the stage peers, and the passes it sends through them.

The driver owns the streams to stage 1 (every answer goes to one event queue), the choice of chain, and three kinds
of pass: training steps (:mod:`hlbp.peer.swarm.stepper`: micro-batches, deadlines, re-runs and the update),
validation and the round's loss guard (:mod:`hlbp.peer.swarm.scoring`), and pings that tell whether the chain is
ready for the next phase.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.swarm.chains import CandidatesFn, Chains
from hlbp.peer.swarm.events import BadPeer, EventQueue, StreamClosed, UnexpectedMessage, decode_answer
from hlbp.peer.swarm.links import Conn, StageLinks
from hlbp.peer.swarm.scoring import ChainBroke, ChainScorer
from hlbp.peer.swarm.server import max_body_bytes
from hlbp.peer.swarm.step import StepAbandoned, StepResult
from hlbp.peer.swarm.stepper import DriverConfig, StepRunner
from hlbp.peer.swarm.transcript import Notary
from hlbp.peer.swarm.worker import StageWorker
from hlbp.protocol.stagewire import StageMessage

__all__ = ["Driver", "DriverConfig", "StepAbandoned", "StepResult"]

logger = logging.getLogger(__name__)


class Driver:
    """Stage 0 of a swarm; ``candidates()`` lists the announced peers of stages 1..S-1 (from the DHT);
    ``shares[i]``: stage i+1's fraction of the model's compute per token, ``grad_bytes[i]`` the bytes of its gradient
    (:class:`~hlbp.peer.swarm.chains.Chains`)."""

    def __init__(self, dht: Any, worker: StageWorker, codec: ActivationCodec, vocab_size: int, cfg: DriverConfig,
                 candidates: CandidatesFn, max_tokens: int, stop: Any = None, notary: Notary | None = None,
                 shares: Sequence[float] = (), grad_bytes: Sequence[int] = ()) -> None:
        if not worker.stage.is_first:
            raise ValueError("the driver holds the first stage")
        # the chain in use, its bans and measured rates
        self.chains = Chains(candidates, cfg.chain_wait_s, stop, shares, grad_bytes)
        self.stop = stop
        self.notary = notary  # signs the frames this driver sends, checks and keeps those it receives
        self.session = random.SystemRandom().randrange(1, 2**63 - 1)
        self._inbox = EventQueue()
        self.links = StageLinks(dht, self._on_message, self._on_closed, self._on_bad, lambda _peer: False,
                                max_body_bytes(codec, max_tokens, vocab_size))
        self.peer_id = self.links.peer_id
        self.steps = StepRunner(worker, codec, vocab_size, cfg, self.chains, self.links, self._inbox, self.session,
                                self._on_bad, stop, notary)
        self.counters = self.steps.counters
        self.scorer = ChainScorer(worker, codec, vocab_size, self.links, self._inbox)  # eval and guard passes

    # --- loop thread: everything goes to the inbox --------------------------------------------------------------

    def _on_message(self, conn: Conn, msg: StageMessage, body: bytes) -> None:
        fault = None if self.notary is None else self.notary.receive(conn.peer, msg, body)
        if fault is not None:
            self._on_bad(conn.peer, fault)
            return
        try:
            answer = decode_answer(conn, msg, body)
        except UnexpectedMessage as exc:
            self._on_bad(conn.peer, str(exc))
            return
        self._inbox.put(answer)

    def _on_closed(self, conn: Conn) -> None:
        self._inbox.put(StreamClosed(conn))

    def _on_bad(self, peer: str, error: str) -> None:
        logger.warning("stage peer %s sent a bad message (%s); banning it", peer[:12], error)
        self._inbox.put(BadPeer(peer, error))

    # --- chain ---------------------------------------------------------------------------------------------------

    def has_chain(self, tokens: int = 1) -> bool:
        """Whether a complete chain of unbanned stage peers is announced now (no waiting)."""
        return self.chains.available(tokens)

    def wait_ready(self, timeout: float, round_: int = 0) -> bool:
        """Wait (at most ``timeout`` seconds) until no peer of the current chain is exchanging an outer round or
        still holds the parameters of a round before ``round_`` (the round whose phase starts).

        A stage peer answers a ping with :attr:`Reason.ROUND` while its round gate is closed or a round behind
        (hlbp.peer.swarm.gate);
        the next step's micro-batches would wait there and run into their deadline, so the driver waits here
        instead. Returns whether the chain was ready in time (a silent peer counts as ready: the step finds it).
        Banned peers are not asked: the next step will not use them, and a dead one would cost a ping timeout."""
        chain = self.chains.live()
        deadline = time.monotonic() + timeout
        while chain and time.monotonic() < deadline:
            if self.stop is not None and self.stop.is_set():
                return False
            _silent, exchanging = self.steps.ping(chain, round_)
            if not exchanging:
                return True
            time.sleep(0.2)
        return not chain

    # --- one step ----------------------------------------------------------------------------------------------------

    def train_step(self, x: torch.Tensor, y: torch.Tensor, opt_step: int, lr: float,
                   round_end: bool = False, give_up: Callable[[], bool] | None = None, round_r: int = 0,
                   inner: int = 0) -> StepResult:
        """One inner step on the batch (x, y) [batch, seq]; raises :class:`StepAbandoned` if it can't finish
        (:meth:`hlbp.peer.swarm.stepper.StepRunner.run` says how each argument is used)."""
        return self.steps.run(x, y, opt_step, lr, round_end, give_up, round_r, inner)

    # --- scoring through the chain (scoring.py) ------------------------------------------------------------------

    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Token-weighted mean loss over ``batches`` through the chain; None if it could not finish."""
        chain = self.chains.choose(batches[0][1].numel(), me=self.peer_id) if batches else None
        if chain is None:
            return None
        return self._scored(self.scorer.evaluate(chain, self.session, self.steps.seq, batches,
                                                 max(30.0, self.steps.latency.deadline())))

    def _scored(self, outcome: float | ChainBroke | None) -> float | None:
        """A scoring pass's loss; a chain that broke under it has its first peer banned (None)."""
        if isinstance(outcome, ChainBroke):
            self.steps.failed(outcome.peer)
            return None
        return outcome

    def guard_loss(self, r: int, params: Mapping[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor],
                   timeout_s: float) -> float | None:
        """The loss of the guard ``batch`` through the chain that ran round ``r``'s last step, with every stage at
        round r's candidate result (this stage's is ``params``; each stage peer holds its own in its guard slot,
        :mod:`hlbp.peer.swarm.guardslot`). None when this driver ran no step of round r, or as
        :meth:`ChainScorer.guard` says."""
        if self.steps.stepped_round != r or not self.chains.chain:
            return None
        return self._scored(self.scorer.guard(list(self.chains.chain), self.session, self.steps.seq, r, params, batch,
                                              timeout_s))

    def busy_fractions(self, wall_s: float) -> dict[str, float]:
        return {p: s / max(wall_s, 1e-9) for p, s in self.counters.busy_s.items()}

    def close(self) -> None:
        self.links.close()
