"""A stage peer's rebalancing check: the pure rule of :mod:`hlbp.peer.node.roles` (``propose_move`` and
``MoveConfirmer``) applied to the run's live announcements and this peer's own work.

The stage loop calls :meth:`Rebalancer.check` as often as it likes; the check reads the announcements (through the
stage's cached swarm view) at most twice a period, counts this peer as idle when it did no step since the last
look, and returns a move only once the same proposal was made twice at least a period apart. The period is the
announcement lifetime: a peer that died without a goodbye vanishes from the records within it, so a gap seen
twice a period apart is not a peer that is merely slow to refresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hlbp.peer.node.roles import MoveConfirmer, PeerView, Role, propose_move


class Rebalancer:
    """``view.peers()``: peer id -> online announcement (cached); ``work()``: a counter of this peer's steps."""

    def __init__(self, me: str, role: Role, throughput: float, n_stages: int, view: Any, work: Callable[[], int],
                 period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.me = PeerView(me, "stage", role.swarm, role.stage, throughput)
        self.n_stages, self.view, self.work, self.clock = n_stages, view, work, clock
        self.period_s = period_s
        self.confirmer = MoveConfirmer(period_s)
        self._at = clock()
        self._work = work()

    def check(self) -> Role | None:
        """The confirmed move, or None (also between two looks, and always with a period of 0: never move)."""
        if self.period_s <= 0:
            return None
        now = self.clock()
        if now - self._at < self.period_s / 2:
            return None
        work = self.work()
        idle, self._at, self._work = work == self._work, now, work
        peers = [PeerView(p, a.role, a.swarm, a.stage, a.throughput) for p, a in self.view.peers().items()
                 if p != self.me.peer_id]
        return self.confirmer.observe(propose_move(self.me, peers, self.n_stages, idle), now)
