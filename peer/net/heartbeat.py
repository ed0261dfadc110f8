"""This peer's heartbeat: its announcement refreshed before it expires, marked offline on leave, and the run
manifest kept alive after its bootstrap is gone."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from hlbp.peer.net.control import ControlPlane, _describe
from hlbp.peer.net.validation import dht_time
from hlbp.protocol.announcement import Announcement
from hlbp.protocol.manifest import SignedManifest

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 5.0  # SIGTERM must end a peer within seconds, even when the DHT no longer answers


class Heartbeat:
    """Re-announces this peer every ``ttl / 3`` seconds in a background thread, so its record never lapses while
    it lives and lapses within ``ttl`` seconds when it dies without a goodbye. On :meth:`leave` it writes one last
    record marked offline. It also keeps the run manifest alive: the bootstrap (``manifest_owner``) re-publishes
    it every beat; any other peer re-publishes it only once its signer stopped doing so, so the run outlives its
    bootstrap.
    """

    def __init__(self, plane: ControlPlane, announcement: Announcement, ttl: float,
                 manifest: SignedManifest | None = None, manifest_owner: bool = False) -> None:
        self.plane = plane
        self.ttl = ttl
        self.manifest = manifest
        self.manifest_owner = manifest_owner
        self._base = announcement
        self._seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="hlbp-heartbeat", daemon=True)
        self.last_size = 0  # bytes of the last record written

    def start(self) -> None:
        self.beat()
        self._keep_manifest()
        self._thread.start()

    def update(self, **changes: Any) -> None:
        """Change announced fields (role, throughput, ...) from the next beat on."""
        with self._lock:
            self._base = replace(self._base, **changes)

    def beat(self, online: bool = True, timeout: float = 30.0) -> None:
        with self._lock:
            self._seq += 1
            now = dht_time()
            record = replace(self._base, seq=self._seq, issued_at=now, expires_at=now + self.ttl, online=online)
        self.last_size = self.plane.announce(record, timeout=timeout)

    def _keep_manifest(self) -> None:
        if self.manifest is None:
            return
        if self.manifest_owner:
            self.plane.publish_manifest(self.manifest.envelope, self.manifest.signer, self.ttl)
            return
        expiry = self.plane.manifest_expiry(self.manifest.signer)
        # The owner refreshes every ttl/3, so a manifest with less than ttl/2 left has lost its owner.
        if expiry is None or expiry < dht_time() + self.ttl / 2:
            self.plane.publish_manifest(self.manifest.envelope, self.manifest.signer, self.ttl)
            logger.info("re-published the run manifest: its signer %s is not refreshing it", self.manifest.signer)

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.beat()
                self._keep_manifest()
            except Exception as exc:  # noqa: BLE001 - a missed beat is survivable: records live ttl, beats every ttl/3
                logger.warning("heartbeat failed (%s); retrying in %.0f s", _describe(exc), self.ttl / 3)

    def leave(self) -> None:
        """Stop beating and mark this peer offline; readers drop it right away instead of after ``ttl``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=LEAVE_TIMEOUT_S)
        try:
            self.beat(online=False, timeout=LEAVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - leaving must not fail: the record will expire on its own
            logger.warning("could not mark this peer offline (%s); its record expires within %.0f s",
                           _describe(exc), self.ttl)
