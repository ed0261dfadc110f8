"""What ``hlbp status --light`` and ``hlbp fetch --light`` do: read a verified view of the run from the first
initial peer that answers, and download an artifact the trusted manifest lists, checking its hash."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.light.client import Fetched, LightDialError, fetch_artifact, fetch_snapshot
from hlbp.peer.light.trust import trusted_signers
from hlbp.protocol import ProtocolError
from hlbp.protocol.manifest import Artifact, Manifest
from hlbp.protocol.snapshot import Snapshot, SnapshotView, verify_snapshot

MAX_INITIAL_PEERS = 8  # initial peers tried in turn before giving up
MAX_SOURCES = 8  # peers an artifact download tries in turn
_HEX = re.compile(r"[0-9a-f]{8,64}")


@dataclass
class LightRun:
    """A verified view of the run and where it came from."""

    view: SnapshotView  # view.manifest is set: a trusted manifest verified
    snapshot: Snapshot  # the raw records, as served
    source: str  # the multiaddr that answered
    fetched: Fetched


def read_run(initial_peers: list[str], manifest_signers: list[str], timeout_s: float,
             now: Callable[[], float] = time.time) -> LightRun:
    """Fetch and verify the snapshot of the first initial peer that answers with a trusted manifest.

    Raises :class:`UserInputError` (one line per peer tried) when none does.
    """
    if not initial_peers:
        raise UserInputError("pass --initial-peers (or HLBP_INITIAL_PEERS): the multiaddr of any peer of the run")
    anchors, explicit = trusted_signers(initial_peers, manifest_signers)
    errors = []
    for maddr in initial_peers[:MAX_INITIAL_PEERS]:
        try:
            snap, fetched = fetch_snapshot(maddr, timeout_s)
        except (LightDialError, ProtocolError) as exc:
            errors.append(str(exc) if isinstance(exc, LightDialError) else f"{maddr} sent a bad snapshot: {exc}")
            continue
        view = verify_snapshot(snap, anchors, explicit, now())
        if view.manifest is not None:
            return LightRun(view, snap, maddr, fetched)
        refused = [exc for signer, exc in view.mismatches.items() if signer in view.trusted]
        if refused:
            raise UserInputError(str(refused[0]))
        bad = [f"{r.author[-8:]}: {r.reason}" for r in view.rejected if r.kind == "manifest"]
        errors.append(f"{maddr} holds no manifest signed by {', '.join(sorted(anchors))}"
                      + (f" (rejected: {'; '.join(bad)[:200]})" if bad else "")
                      + ("" if explicit else "; if this peer is not the bootstrap, pass --manifest-signer "
                                             "<bootstrap peer id>"))
    raise UserInputError(errors[0] if len(errors) == 1 else "no initial peer answered: " + " | ".join(errors))


def resolve_artifact(manifest: Manifest, wanted: str) -> Artifact:
    """The manifest's artifact whose sha256 is ``wanted`` or starts with it (at least 8 hex digits, as
    ``hlbp bootstrap`` prints 12)."""
    wanted = wanted.strip().lower()
    if not _HEX.fullmatch(wanted):
        raise UserInputError(f"{wanted[:80]!r} is not an artifact hash: give its sha256, or at least its first 8 "
                             "hex digits")
    matches = [a for a in manifest.artifacts if a.sha256.startswith(wanted)]
    listed = ", ".join(f"{a.name} {a.sha256[:12]}" for a in manifest.artifacts) or "none"
    if not matches:
        raise UserInputError(f"the manifest of run {manifest.run_id} lists no artifact with hash {wanted[:16]}…; "
                             f"it lists: {listed}")
    if len(matches) > 1:
        raise UserInputError(f"{wanted} matches several artifacts ({listed}); give more of the hash")
    return matches[0]


def artifact_sources(run: LightRun, sha256: str) -> list[str]:
    """Multiaddrs to download ``sha256`` from: the peer that answered first, then online peers that announce it."""
    sources = [run.source]
    for rec in run.view.peers.values():
        a = rec.announcement
        if a.online and sha256 in a.artifacts:
            sources.extend(m for m in a.maddrs[:2] if "/p2p/" in m and m not in sources)
    return sources[:MAX_SOURCES]


def download(run: LightRun, artifact: Artifact, dest: Path, timeout_s: float) -> tuple[Fetched, str]:
    """Download ``artifact`` to ``dest`` from the first source that sends bytes with its hash: (fetch, source)."""
    errors = []
    for maddr in artifact_sources(run, artifact.sha256):
        try:
            return fetch_artifact(maddr, artifact.sha256, artifact.size, dest, timeout_s), maddr
        except (LightDialError, ProtocolError) as exc:
            errors.append(f"{maddr.split('/p2p/')[-1][-8:]}: {str(exc)[:160]}")
    raise UserInputError(f"could not fetch {artifact.name} ({artifact.sha256[:12]}…) from any peer: "
                         + "; ".join(errors))
