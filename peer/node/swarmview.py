"""The stage peers of one swarm as the run's announcements in the DHT show them: who may call whom, and who is at
which stage (a stage peer's routing, standby and rebalancing read this view)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

PEERS_REFRESH_S = 2.0  # how stale the driver's and the servers' view of the swarm may be


class SwarmView:
    """The run's stage peers from the DHT, re-read at most every :data:`PEERS_REFRESH_S` seconds."""

    def __init__(self, plane: Any, manifest: Any, swarm: int) -> None:
        self.plane, self.m, self.swarm = plane, manifest, swarm
        self._at = 0.0
        self._peers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def peers(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._at > PEERS_REFRESH_S:
                try:
                    self._peers = {p: r.announcement for p, r in self.plane.read_peers(self.m.run_id).items()
                                   if r.announcement.online and self.m.may_contribute(p)}
                    self._at = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - keep the last view; the DHT may be busy
                    logger.debug("reading the swarm's peers failed: %s", exc)
            return dict(self._peers)

    def members(self) -> frozenset[str]:
        """The peers announcing this swarm, at any stage."""
        return frozenset(p for p, a in self.peers().items() if a.role == "stage" and a.swarm == self.swarm)

    def at_stage(self, stage: int) -> list[tuple[str, float, float]]:
        """The peers announcing this swarm's stage ``stage``: (peer, throughput, bandwidth) sorted by peer id."""
        return sorted((p, a.throughput, a.bandwidth) for p, a in self.peers().items()
                      if a.role == "stage" and a.swarm == self.swarm and a.stage == stage)

    def at_same_stage(self, peer: str, my_stage: int) -> bool:
        """Whether ``peer`` announces this swarm's stage ``my_stage`` (it may trade gradients with us)."""
        a = self.peers().get(peer)
        return a is not None and a.role == "stage" and a.swarm == self.swarm and a.stage == my_stage

    def may_call(self, peer: str, my_stage: int) -> bool:
        a = self.peers().get(peer)
        if a is None:  # maybe it announced a moment ago
            self._at = 0.0
            a = self.peers().get(peer)
        return a is not None and a.role == "stage" and a.swarm == self.swarm and a.stage is not None \
            and a.stage < my_stage
