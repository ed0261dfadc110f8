"""The snapshot of a run that any hlbp node serves on its data plane, and its verification by a reader.

A snapshot carries the records a node reads from the DHT, each exactly as its author signed it: the manifests,
the run's peer announcements, every replica's latest shard checksums, and the accepted sets of the newest round.
The node that serves it signs nothing itself, so it cannot vouch for anything: :func:`verify_snapshot` checks
every record against its author's peer id with the same decoders the DHT readers use, and a record that fails
is reported as rejected, never used. This is what lets a light client (``hlbp status --light``) trust a node it
dialled no more than the DHT itself.

Wire: a request is a data-plane header (:mod:`hlbp.protocol.frames`) ``{"op": "snapshot", "v": 1}``; the response
header is ``{"size": n}`` and the body is one canonical msgpack map (:func:`encode_snapshot`). Pure functions
over bytes; every decoder raises :class:`ProtocolError` and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from hlbp.protocol.announcement import MAX_ANNOUNCEMENT_BYTES, SignedAnnouncement, decode_announcement
from hlbp.protocol.errors import ProtocolError, RecordExpired
from hlbp.protocol.manifest import (
    MAX_MANIFEST_BYTES,
    RUN_ID_RE,
    ProtocolVersionMismatch,
    SignedManifest,
    decode_manifest,
)
from hlbp.protocol.roundwire import (
    MAX_RECORD_BYTES,
    AcceptedSet,
    ShardChecks,
    parse_accepted,
    parse_checks,
)
from hlbp.protocol.untrusted import preview, unpack_msgpack

SNAPSHOT_SCHEMA = 1
SNAPSHOT_OP = "snapshot"
MAX_SNAPSHOT_BYTES = 4 << 20  # about 6,000 announcements; a server leaves out what does not fit
MAX_PEER_ID_CHARS = 128
# (field of the snapshot, most entries, largest entry): the same bounds the DHT readers apply
SECTIONS = {
    "manifests": (64, MAX_MANIFEST_BYTES),
    "peers": (4096, MAX_ANNOUNCEMENT_BYTES),
    "checks": (1024, MAX_RECORD_BYTES),
    "accepted": (16, MAX_RECORD_BYTES),
}


@dataclass(frozen=True)
class Snapshot:
    """Raw signed records by author peer id, as one node holds them. Nothing in it is verified yet."""

    run_id: str  # the run the serving node takes part in (unsigned: a hint, the manifest decides)
    served_at: float  # the serving node's clock (unsigned; shown, never trusted)
    manifests: dict[str, bytes] = field(default_factory=dict)  # signer -> manifest envelope
    peers: dict[str, bytes] = field(default_factory=dict)  # peer id -> announcement envelope
    checks: dict[str, bytes] = field(default_factory=dict)  # peer id -> latest shard checksums envelope
    accepted_round: int | None = None  # the newest round with published checksums
    accepted: dict[str, bytes] = field(default_factory=dict)  # coordinator -> that round's accepted set


def snapshot_request() -> dict[str, Any]:
    """The request header a client sends."""
    return {"op": SNAPSHOT_OP, "v": SNAPSHOT_SCHEMA}


def parse_snapshot_request(header: dict[str, Any]) -> None:
    """Raise :class:`ProtocolError` unless ``header`` asks for a snapshot of a schema this node serves."""
    if header.get("op") != SNAPSHOT_OP:
        raise ProtocolError(f"this handler serves snapshots only, not {preview(header.get('op'), 16)}")
    if header.get("v") != SNAPSHOT_SCHEMA:
        raise ProtocolError(f"snapshot schema {preview(header.get('v'), 8)} is not served here (this node serves "
                            f"{SNAPSHOT_SCHEMA}); upgrade hlbp")


def build_snapshot(run_id: str, served_at: float, sections: dict[str, dict[Any, Any]],
                   accepted_round: int | None = None) -> Snapshot:
    """A snapshot of what a node read, within the bounds: entries that are not (peer id, bytes) or exceed the
    size of their kind are left out (a reader would reject them anyway), then whole entries from the end of each
    section until the encoding fits :data:`MAX_SNAPSHOT_BYTES`."""
    kept: dict[str, dict[str, bytes]] = {}
    budget = MAX_SNAPSHOT_BYTES - 4096  # room for the map itself, the run id and the numbers
    for name, (max_entries, max_bytes) in SECTIONS.items():
        out: dict[str, bytes] = {}
        for key, value in (sections.get(name) or {}).items():
            value = getattr(value, "value", value)  # DHT entries come wrapped with their expiration
            if len(out) >= max_entries:
                break
            if not (isinstance(key, str) and 0 < len(key) <= MAX_PEER_ID_CHARS and isinstance(value, bytes)
                    and len(value) <= max_bytes):
                continue
            cost = len(key) + len(value) + 16
            if cost > budget:
                break
            budget -= cost
            out[key] = value
        kept[name] = out
    return Snapshot(run_id, float(served_at), kept["manifests"], kept["peers"], kept["checks"], accepted_round,
                    kept["accepted"])


def encode_snapshot(snap: Snapshot) -> bytes:
    """The canonical msgpack body of a snapshot response."""
    body = msgpack.packb({
        "v": SNAPSHOT_SCHEMA, "run": snap.run_id, "time": float(snap.served_at),
        "manifests": snap.manifests, "peers": snap.peers, "checks": snap.checks,
        "accepted_round": snap.accepted_round, "accepted": snap.accepted,
    }, use_bin_type=True)
    if len(body) > MAX_SNAPSHOT_BYTES:
        raise ProtocolError(f"a snapshot of {len(body)} bytes exceeds {MAX_SNAPSHOT_BYTES}; build it with "
                            "build_snapshot, which keeps it within bounds")
    return body


def _section(body: dict[str, Any], name: str) -> dict[str, bytes]:
    max_entries, max_bytes = SECTIONS[name]
    value = body.get(name, {})
    if not isinstance(value, dict) or len(value) > max_entries:
        raise ProtocolError(f"snapshot field {name!r} must map at most {max_entries} peer ids to records")
    for key, record in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_PEER_ID_CHARS:
            raise ProtocolError(f"snapshot field {name!r}: {preview(key, 16)} is not a peer id")
        if not isinstance(record, bytes) or len(record) > max_bytes:
            raise ProtocolError(f"snapshot field {name!r}: the record of {key[:60]} is not bytes of at most "
                                f"{max_bytes}")
    return value


def decode_snapshot(data: Any) -> Snapshot:
    """Parse a snapshot body: bounded, canonical msgpack of the shape :func:`encode_snapshot` writes.

    Only the shape is checked here; the records inside are checked by :func:`verify_snapshot`.
    """
    body = unpack_msgpack(data, max_bytes=MAX_SNAPSHOT_BYTES, what="snapshot", max_depth=2)
    if not isinstance(body, dict):
        raise ProtocolError("a snapshot is a map")
    if body.get("v") != SNAPSHOT_SCHEMA:
        raise ProtocolError(f"snapshot schema {preview(body.get('v'), 8)} is not {SNAPSHOT_SCHEMA}; upgrade hlbp")
    run_id = body.get("run")
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise ProtocolError("snapshot field 'run' is not a run id")
    served_at = body.get("time")
    if isinstance(served_at, bool) or not isinstance(served_at, (int, float)) or not math.isfinite(served_at):
        raise ProtocolError("snapshot field 'time' must be a finite number")
    accepted_round = body.get("accepted_round")
    if accepted_round is not None and (isinstance(accepted_round, bool) or not isinstance(accepted_round, int)
                                       or not 0 <= accepted_round < 1 << 40):
        raise ProtocolError("snapshot field 'accepted_round' must be a round number or nil")
    return Snapshot(run_id, float(served_at), _section(body, "manifests"), _section(body, "peers"),
                    _section(body, "checks"), accepted_round, _section(body, "accepted"))


# ---------------------------------------------------------------------------------------------------------------
# Verification: what a reader may believe of a snapshot
# ---------------------------------------------------------------------------------------------------------------


def choose_manifest(manifests: list[SignedManifest], trusted: set[str]) -> SignedManifest | None:
    """The newest manifest among those signed by a trusted peer id (ties: smallest signer, for determinism)."""
    candidates = [m for m in manifests if m.signer in trusted]
    if not candidates:
        return None
    return max(candidates, key=lambda m: (m.manifest.issued_at, [-ord(c) for c in m.signer]))


@dataclass(frozen=True)
class Rejected:
    """A record of the snapshot that was not used, and why."""

    kind: str  # manifest, announcement, checks or accepted
    author: str  # the peer id it is filed under (its claimed author)
    reason: str


@dataclass
class SnapshotView:
    """What a snapshot proves: records whose signatures, authors, run and shapes all check out."""

    manifest: SignedManifest | None  # the newest manifest of a trusted signer; None: no trusted one verified
    peers: dict[str, SignedAnnouncement]  # the run's unexpired announcements, by peer id
    checks: list[ShardChecks]  # every replica's latest shard checksums
    accepted_round: int | None
    accepted: list[AcceptedSet]  # that round's accepted sets (one per coordinator that published one)
    rejected: list[Rejected]  # every record that failed a check
    mismatches: dict[str, ProtocolVersionMismatch]  # well-signed manifests of another protocol version, by signer
    trusted: set[str]  # the signers a manifest was accepted from


def verify_snapshot(snap: Snapshot, anchors: set[str], explicit: bool, now: float) -> SnapshotView:
    """Check every record of ``snap`` and keep those that verify.

    Trust follows :meth:`hlbp.peer.net.control.ControlPlane.find_manifest`: a manifest counts only if it is signed
    by an anchor (the dialled peer's id, or the ``--manifest-signer`` ids when ``explicit``), or, unless
    ``explicit``, by the signer an anchor's own verified announcement names. Announcements, checksums and accepted
    sets must be signed by the peer id they are filed under and name the chosen manifest's run. An expired
    announcement is dropped silently (it is the normal end of a record); anything else that fails is rejected.
    """
    rejected: list[Rejected] = []
    manifests: list[SignedManifest] = []
    mismatches: dict[str, ProtocolVersionMismatch] = {}
    for signer, data in snap.manifests.items():
        try:
            manifests.append(decode_manifest(data, signer=signer))
        except ProtocolVersionMismatch as exc:
            mismatches[signer] = exc
            rejected.append(Rejected("manifest", signer, str(exc)))
        except ProtocolError as exc:
            rejected.append(Rejected("manifest", signer, str(exc)))
    announcements: dict[str, SignedAnnouncement] = {}
    for peer_id, data in snap.peers.items():
        try:
            announcements[peer_id] = decode_announcement(data, now=now, signer=peer_id)
        except RecordExpired:
            continue  # expiry is the normal end of a record, not a rejection
        except ProtocolError as exc:
            rejected.append(Rejected("announcement", peer_id, str(exc)))
    trusted = set(anchors)
    if not explicit:
        trusted |= {announcements[a].announcement.manifest_signer for a in anchors if a in announcements}
    chosen = choose_manifest(manifests, trusted)
    for m in manifests:
        if chosen is None or m.signer != chosen.signer:
            rejected.append(Rejected("manifest", m.signer, "signed by a peer that is not a trusted manifest signer"))
    if chosen is None:
        return SnapshotView(None, {}, [], None, [], rejected, mismatches, trusted)
    run_id = chosen.manifest.run_id
    peers = {}
    for peer_id, rec in announcements.items():
        if rec.announcement.run_id == run_id:
            peers[peer_id] = rec
        else:
            rejected.append(Rejected("announcement", peer_id, f"belongs to run {rec.announcement.run_id!r}, "
                                                              f"not {run_id!r}"))
    checks = []
    for peer_id, data in snap.checks.items():
        try:
            checks.append(parse_checks(data, peer_id, run_id))
        except ProtocolError as exc:
            rejected.append(Rejected("checks", peer_id, str(exc)))
    accepted = []
    for coordinator, data in snap.accepted.items():
        if snap.accepted_round is None:  # a set of any round would pass for the round the view shows
            rejected.append(Rejected("accepted", coordinator, "the snapshot names no round for its accepted sets"))
            continue
        try:
            accepted.append(parse_accepted(data, coordinator, run_id, round_=snap.accepted_round))
        except ProtocolError as exc:
            rejected.append(Rejected("accepted", coordinator, str(exc)))
    return SnapshotView(chosen, peers, checks, snap.accepted_round, accepted, rejected, mismatches, trusted)
