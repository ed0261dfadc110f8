"""A peer announcement, published by every peer of a run and refreshed by heartbeats: its role, stage, swarm,
measured capacity, software version and reachability, in a signed envelope that expires.

Like the manifest (:mod:`hlbp.protocol.manifest`), a pure function over bytes: no network, no clock (callers pass
``now``). Every decoder raises :class:`ProtocolError` (:class:`RecordExpired` for an expired record) on bad input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hlbp.protocol.errors import ProtocolError, RecordExpired
from hlbp.protocol.fields import _float, _int, _opt_int, _str, _str_list
from hlbp.protocol.identity import Identity, open_envelope, seal
from hlbp.protocol.manifest import PROTOCOL_VERSION, RUN_ID_RE, SHA256_RE, ProtocolVersionMismatch

KIND_ANNOUNCEMENT = "announce"
MAX_ANNOUNCEMENT_BYTES = 4 * 1024
MAX_RECORD_TTL_S = 3600.0  # an announcement may not claim to live longer than this
MAX_CLOCK_SKEW_S = 120.0  # tolerated difference between a signer's clock and ours
ROLES = ("replica", "stage", "bootstrap")
REACHABILITY = ("public", "client", "unknown")


def peers_key(run_id: str) -> str:
    """DHT key under which the peers of ``run_id`` announce themselves, one subkey (their peer id) each."""
    return f"hlbp:{run_id}:peers"


# ---------------------------------------------------------------------------------------------------------------
# Peer announcement
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Announcement:
    """What a peer tells the swarm about itself. Signed, expiring, versioned by ``seq``."""

    run_id: str  # the run this peer takes part in
    role: str  # replica, stage or bootstrap
    swarm: int | None = None  # pipeline swarm, for stage peers
    stage: int | None = None  # stage index within the swarm, for stage peers
    throughput: float = 0.0  # measured training speed, in full-model tokens/s
    bandwidth: float = 0.0  # measured download bandwidth from a peer, bytes/s
    memory_gb: float = 0.0  # available memory when it joined
    software: str = ""  # hlbp version string
    reachability: str = "unknown"  # public: others can dial it; client: it only dials out
    online: bool = True  # False in the last record a peer writes when it leaves
    maddrs: tuple[str, ...] = ()  # multiaddrs it listens on, for data-plane streams
    artifacts: tuple[str, ...] = ()  # sha256 of the artifacts it serves
    manifest_signer: str = ""  # the manifest this peer follows: signer peer id ...
    manifest_digest: str = ""  # ... and envelope digest; lets a joiner trust a manifest through this peer
    seq: int = 0  # grows with every record the peer writes; the newest wins
    issued_at: float = 0.0  # signer's clock when written: the peer's "last seen"
    expires_at: float = 0.0  # readers drop the record after this time
    protocol_version: int = PROTOCOL_VERSION

    def to_body(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "proto": self.protocol_version,
            "seq": self.seq,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "role": self.role,
            "swarm": self.swarm,
            "stage": self.stage,
            "throughput": self.throughput,
            "bandwidth": self.bandwidth,
            "memory_gb": self.memory_gb,
            "software": self.software,
            "reachability": self.reachability,
            "online": self.online,
            "maddrs": list(self.maddrs),
            "artifacts": list(self.artifacts),
            "manifest_signer": self.manifest_signer,
            "manifest_digest": self.manifest_digest,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Announcement:
        proto = _int(body, "proto", 0, 1 << 30)
        if proto != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(proto)
        online = body.get("online", True)
        if not isinstance(online, bool):
            raise ProtocolError("record field 'online' must be a boolean")
        ann = cls(
            run_id=_str(body, "run", 64, pattern=RUN_ID_RE),
            protocol_version=proto,
            seq=_int(body, "seq", 0, (1 << 63) - 1),
            issued_at=_float(body, "issued_at", 0.0, 1e11),
            expires_at=_float(body, "expires_at", 0.0, 1e11),
            role=_str(body, "role", 16, choices=ROLES),
            swarm=_opt_int(body, "swarm", 0, 1 << 20),
            stage=_opt_int(body, "stage", 0, 255),
            throughput=_float(body, "throughput", 0.0, 1e12, 0.0),
            bandwidth=_float(body, "bandwidth", 0.0, 1e13, 0.0),
            memory_gb=_float(body, "memory_gb", 0.0, 1e6, 0.0),
            software=_str(body, "software", 64, ""),
            reachability=_str(body, "reachability", 16, "unknown", choices=REACHABILITY),
            online=online,
            maddrs=_str_list(body, "maddrs", 8, 256),
            artifacts=_str_list(body, "artifacts", 16, 64, pattern=SHA256_RE),
            manifest_signer=_str(body, "manifest_signer", 64, ""),
            manifest_digest=_str(body, "manifest_digest", 64, ""),
        )
        if ann.role == "stage" and (ann.swarm is None or ann.stage is None):
            raise ProtocolError("a stage peer's record must name its swarm and stage")
        if not 0 < ann.expires_at - ann.issued_at <= MAX_RECORD_TTL_S:
            raise ProtocolError(f"a record must expire within {MAX_RECORD_TTL_S:.0f} s of being issued")
        return ann


@dataclass(frozen=True)
class SignedAnnouncement:
    announcement: Announcement
    peer_id: str  # the signer, which is the announcing peer
    size: int  # envelope bytes, for reporting


def encode_announcement(announcement: Announcement, identity: Identity) -> bytes:
    data = seal(KIND_ANNOUNCEMENT, announcement.to_body(), identity)
    if len(data) > MAX_ANNOUNCEMENT_BYTES:
        raise ProtocolError(f"an announcement encodes to {len(data)} bytes, over the {MAX_ANNOUNCEMENT_BYTES} limit")
    return data


def decode_announcement(data: Any, *, now: float, signer: str | None = None,
                        run_id: str | None = None) -> SignedAnnouncement:
    """Verify and parse an announcement; expired records raise RecordExpired, other bad ones ProtocolError."""
    env = open_envelope(data, KIND_ANNOUNCEMENT, max_bytes=MAX_ANNOUNCEMENT_BYTES, signer=signer)
    ann = Announcement.from_body(env.body)
    if ann.expires_at < now:
        raise RecordExpired(f"the record of {env.signer[:60]} expired {now - ann.expires_at:.0f} s ago")
    if ann.issued_at > now + MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"the record of {env.signer[:60]} is dated {ann.issued_at - now:.0f} s in the future")
    if run_id is not None and ann.run_id != run_id:
        raise ProtocolError(f"the record of {env.signer[:60]} belongs to run {ann.run_id!r}, not {run_id!r}")
    return SignedAnnouncement(ann, env.signer, len(data))
