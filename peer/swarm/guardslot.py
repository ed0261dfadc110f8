"""A stage peer's side of the swarm's loss guard: the round's candidate result, held while its driver scores it
through the chain, and the guard losses that pass on their way back.

A full replica scores each round's result on the run's fixed guard batch before it commits, and refuses a round
whose loss jumps or climbs past the manifest's bounds (:func:`hlbp.peer.rounds.guard.loss_reason`). A stage peer
holds one stage and cannot score anything alone; its swarm can. In a round without a full replica, once a stage
peer has computed round r's result for its shard, it holds that candidate here and waits while the driver sends the
guard batch (``guard`` messages) through its chain: each stage runs it at its candidate, the last stage computes the
loss and sends it back up (``gloss``), and every stage of the chain records it on the way. Each stage judges the
loss against its last rounds' as a full replica does, so a shard that only stage peers hold is bounded by the loss
of the whole model, not only by norms.

The two sides meet in any order: a ``guard`` that arrives before this stage holds its round's candidate waits here
(a bounded number, for that round or later ones only) and runs once it does; one it will never run (a round it has
passed, or one its round loop never reached) is answered at once with a ``gloss`` that says so, so a driver whose
chain cannot score a round does not wait for it. A stage peer that served none of round r's steps is not in its
driver's chain (a standby) and does not wait; one whose driver sends no guard (no chain, or a round that went
another way there) waits :data:`GUARD_GRACE_S` for it to arrive, then judges by the norms alone. Nothing here
blocks the stage's compute thread; only the round thread waits, with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from enum import Enum

import torch

GUARD_TIMEOUT_S = 15.0  # how long a chain's guard may take once it has begun (then: the norm bounds alone judge)
# how long a stage holding its candidate waits for its driver's guard to arrive at all: the driver sends it when
# its own apply of the round gets there, a little before or after this stage's; a driver that has no guard to send
# (no chain, or its round went another way) costs its chain no more than this
GUARD_GRACE_S = 10.0
MAX_HELD = 16  # guard messages held for a candidate not yet offered (the guard batch is a few micro-batches)
SERVED_ROUNDS = 8  # rounds whose steps this stage served, remembered to know whether it is in the chain

class Delivery(Enum):
    """What became of a guard that reached this stage (:meth:`GuardSlot.deliver`)."""

    RUN = "run"  # its round's candidate is under guard now: run it
    HELD = "held"  # kept until that candidate is: run then, or refused (its ``refuse`` called) if that never comes
    REFUSED = "refused"  # a round already past, too far ahead, or too many waiting: answer that it has no loss


class GuardSlot:
    """The candidate under guard and the guard losses seen for it; shared by the stage's round thread
    (:meth:`score`) and its server (:meth:`deliver`, :meth:`params`, :meth:`record`, :meth:`served`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._round = -1  # the round whose candidate is (or was last) under guard
        self._params: Mapping[str, torch.Tensor] | None = None
        self._held: list[tuple[int, Callable[[], None], Callable[[], None]]] = []  # (round, run, refuse)
        self._arrived: set[int] = set()  # rounds whose guard reached this stage, run or held
        self._losses: dict[int, float] = {}  # micro-batch -> loss, of the round under guard
        self._unscored = False  # a guard of the round under guard was answered unscored: its losses cannot all come
        self._served: list[int] = []

    # --- the server's side ----------------------------------------------------------------------------------------

    def served(self, r: int) -> None:
        """This stage computed a step of round ``r``'s phase for its swarm: it is in the chain that will score it."""
        with self._cond:
            if r not in self._served:
                self._served = [*self._served[-SERVED_ROUNDS + 1:], r]

    def params(self, r: int) -> Mapping[str, torch.Tensor] | None:
        """Round ``r``'s candidate, if it is held under guard now."""
        with self._cond:
            return self._params if self._round == r else None

    def deliver(self, r: int, run: Callable[[], None], refuse: Callable[[], None]) -> Delivery:
        """A guard of round ``r`` arrived. :attr:`Delivery.HELD` keeps ``run`` until :meth:`score` holds that
        round's candidate, or calls ``refuse`` (from the round thread) once a later round's is held instead."""
        with self._cond:
            ahead = self._round >= 0 and r > self._round + SERVED_ROUNDS
            if r < self._round or ahead or len(self._arrived) >= 4 * MAX_HELD:
                return Delivery.REFUSED
            self._arrived.add(r)
            self._cond.notify_all()
            if self._round == r:
                return Delivery.RUN if self._params is not None else Delivery.REFUSED
            if len(self._held) >= MAX_HELD:
                return Delivery.REFUSED
            self._held.append((r, run, refuse))
            return Delivery.HELD

    def record(self, r: int, mb: int, loss: float) -> None:
        """A guard loss of round ``r`` seen on its way up the chain (or computed here, on the last stage)."""
        with self._cond:
            if r == self._round and self._params is not None and mb < MAX_HELD:
                self._losses.setdefault(mb, loss)
                self._cond.notify_all()

    def unscored(self, r: int) -> None:
        """A guard of round ``r`` passed this stage on its way up answered unscored (a stage below holds no
        candidate, or the chain broke below): that round's score waits no longer."""
        with self._cond:
            if r == self._round and self._params is not None:
                self._unscored = True
                self._cond.notify_all()

    # --- the round thread's side ----------------------------------------------------------------------------------

    def score(self, r: int, params: Mapping[str, torch.Tensor], count: int = 1, grace_s: float = GUARD_GRACE_S,
              timeout_s: float = GUARD_TIMEOUT_S) -> float | None:
        """The round loop's guard loss on a stage server: hold ``params`` as round ``r``'s candidate, run the guards
        that waited for it, and wait for the chain's ``count`` losses (micro-batches of equal size): their mean, or
        None when this stage served none of round r's steps (a standby: no guard comes its way), when no guard
        arrived within ``grace_s``, or when the losses did not come within ``timeout_s``."""
        with self._cond:
            self._round, self._params, self._losses, self._unscored = r, params, {}, False
            ready = [run for rr, run, _ in self._held if rr == r]
            passed = [refuse for rr, _, refuse in self._held if rr < r]
            self._held = [h for h in self._held if h[0] > r]
            self._arrived = {rr for rr in self._arrived if rr >= r}
            in_chain = r in self._served
        try:
            for job in [*passed, *ready]:
                job()
            if not in_chain:
                return None
            return self._wait(r, count, grace_s, timeout_s)
        finally:
            with self._cond:
                if self._round == r:
                    self._params = None
                    self._cond.notify_all()

    def _wait(self, r: int, count: int, grace_s: float, timeout_s: float) -> float | None:
        start = time.monotonic()
        with self._cond:
            while r not in self._arrived:
                left = start + grace_s - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            while len(self._losses) < count:
                left = start + timeout_s - time.monotonic()
                if left <= 0 or self._unscored:
                    return None
                self._cond.wait(left)
            return sum(self._losses[mb] for mb in sorted(self._losses)[:count]) / count
