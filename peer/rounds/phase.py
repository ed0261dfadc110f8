"""A replica's inner phase of a round: up to H AdamW steps from the round's start, cut short when the round closes
without us, sat out right after a state sync, and caught up under overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hlbp.peer.rounds.config import RoundConfig

logger = logging.getLogger(__name__)

PHASE_CHECK_S = 0.25  # how often the inner phase looks (without waiting) whether its round closed or started


class InnerPhase:
    """The inner phases of one round loop.

    ``closed(r, wait)`` / ``started(r, wait)``: whether round r closed without us / others announced it (``wait``
    False: answer from what was last polled or pushed, never waiting on the DHT). ``base()``: where the phase
    under way started (a rollback returns there). ``after_step(r, step)``: called on this thread after each step
    (an overlapped exchange lands its result there). ``steps(r)``: a phase whose steps run elsewhere (a stage
    peer's are its swarm's), in place of the local trainer's. ``holding_up(r)``: whether the others wait for our
    close of round r (:func:`hlbp.peer.rounds.rules.holds_up`; never waiting on the DHT); the phase then ends.
    """

    def __init__(self, trainer: Any, cfg: RoundConfig, stop: Any, closed: Callable[[int, bool], bool],
                 started: Callable[[int, bool], bool], base: Callable[[], Mapping[str, torch.Tensor]],
                 after_step: Callable[[int, int], None],
                 steps: Callable[[int], tuple[int, int]] | None = None, sit_out: bool = True,
                 holding_up: Callable[[int], bool] = lambda r: False) -> None:
        self.trainer, self.cfg, self.stop, self.sit_out = trainer, cfg, stop, sit_out
        self.holding_up = holding_up
        self.closed, self.started, self.base, self.after_step, self.steps = closed, started, base, after_step, steps
        self.just_synced = False  # set after a state sync: we arrive mid-run, and the next round may be under way
        # under overlap: the round whose phase started behind the others' (after a sit-out, or after our notice of
        # the round before came too late); that phase ends early once others announce it (see run)
        self.catch_up_round = -1
        self.rollbacks = 0  # phases abandoned because the loss stopped being finite

    def run(self, r: int) -> tuple[int, int]:
        """Up to H inner steps from the anchor, cut short when round r closes without us; (steps, tokens).

        Right after a state sync (a joiner, a restart that found the swarm moved on, a peer that fell out of sync)
        a round whose contributions others are already announcing is sat out: no steps, weight 0, as a newcomer
        takes part. Training for it would finish after it closes, and applying its result that late would leave
        us behind for the next round too; taking the result at once starts the next round with everybody, so the
        peer contributes from its second round on.

        Under overlap "everybody" started that next phase earlier: each replica starts it as soon as it has
        announced the round we sat out, so we begin it up to a phase behind them, and a late start is never made
        up (nothing re-aligns phases under overlap). So the phase after a sit-out catches up: it ends, after at
        least one step, as soon as others announce it, and contributes the steps it made (measured before: a
        restarted peer was left out of that round too, and of the next). The same holds after a round that
        closed without our (late) contribution: the phase under way started at that late notice, so the exchange
        thread marks it (``catch_up_round``) and it ends once others announce it, instead of staying a constant
        offset behind them round after round.
        """
        if self.just_synced:
            self.just_synced = False
            if self.sit_out and self.started(r, True):
                logger.info("round %d is already being announced by others: taking its result with weight 0 and "
                            "starting the next round with them", r)
                if self.cfg.overlap != "none":
                    self.catch_up_round = r + 1
                return 0, 0
        return self.steps(r) if self.steps is not None else self.train(r)

    def train(self, r: int) -> tuple[int, int]:
        """The inner steps of round r: H AdamW steps of the local trainer (a stage peer's are its swarm's). When
        ``catch_up_round`` is r, set before the phase or by the exchange while it runs, the phase ends after at
        least one step once others announce round r (see :meth:`run`). It also ends after at least one step when
        the others wait for our close (``holding_up``): a slow head of the turn order contributes what it made
        instead of holding every peer until the next in turn takes over."""
        tokens0 = self.trainer.tokens
        steps, last_check = 0, 0.0
        for _ in range(self.cfg.inner_steps):
            if self.stop.is_set():
                break
            if time.perf_counter() - last_check > PHASE_CHECK_S:
                # what the phase's poller last read plus what was pushed: a step never waits on a DHT lookup
                last_check = time.perf_counter()
                if self.closed(r, False):
                    break  # the round closed without us: stop computing and take its result
                if self.catch_up_round == r and steps and self.started(r, False):
                    logger.info("round %d: others are announcing it; contributing the %d steps made since catching "
                                "up", r, steps)
                    break
                if steps and self.holding_up(r):
                    logger.info("round %d: the others announced it and wait for our close; contributing the %d steps "
                                "made", r, steps)
                    break
            try:
                self.trainer.train_step()
            except FloatingPointError as exc:
                self._roll_back(r, exc)
                return 0, 0
            steps += 1
            self.after_step(r, steps)
        return steps, self.trainer.tokens - tokens0

    def _roll_back(self, r: int, exc: FloatingPointError) -> None:
        """The inner loss stopped being finite: go back to the round's global parameters with a fresh inner
        optimizer, and sit this round out (weight 0) instead of exiting. The global parameters passed the round
        guard, so a peer's own bad luck (or a bad batch) costs it one round, never the run."""
        logger.warning("round %d: %s; rolling back to the round's global parameters with fresh AdamW moments and "
                       "sitting this round out", r, exc)
        self.trainer.optimizer.state.clear()
        self.trainer.load_params(self.base())
        self.rollbacks += 1
