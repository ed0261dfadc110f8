"""Signed DHT records of the round protocol: contribution notices, accepted sets and shard checksums.

Each record is a :func:`hlbp.protocol.manifest.seal` envelope, so it is bound to its signer's peer id; the body
names the run and round, so a record cannot be replayed into another round. Parsing enforces types, ranges and
sizes and raises :class:`ProtocolError` for anything else. Unknown body fields are ignored (forward compatible).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.fields import _bool
from hlbp.protocol.identity import Identity, open_envelope, seal
from hlbp.protocol.untrusted import preview

KIND_CONTRIB = "contrib"
KIND_ACCEPTED = "accepted"
KIND_CHECKS = "checks"
KIND_BUNDLE = "bundle"  # others' records passed on by a committee member (hlbp.protocol.bundle); pushed, never stored
# hivemind's DHT command pipe hangs on messages over 64 KiB, so every record stays well below that
MAX_RECORD_BYTES = 48 * 1024  # an accepted set of 256 members is about 35 KB
MAX_MEMBERS = 256
MAX_SHARDS = 256
MAX_PAYLOAD_BYTES = 1 << 34  # a contribution's announced size; the fetcher applies its own, tighter limit
# used with fullmatch: "$" after re.match would let a trailing newline pass
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")
_SHARD_KEY = re.compile(r"0|[1-9][0-9]{0,2}")  # canonical decimal: no leading zeros, ASCII digits only


def round_key(run_id: str, round_: int, what: str) -> str:
    """DHT key of one round's records of one kind (``contrib``, ``accepted``)."""
    return f"hlbp:{run_id}:round:{round_}:{what}"


def checks_key(run_id: str) -> str:
    """DHT key of the latest shard checksums of every peer of a run (subkey: peer id)."""
    return f"hlbp:{run_id}:checks"


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise ProtocolError(f"record lacks field {name!r}")
    value = body[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"record field {name!r} has the wrong type")
    return value


def _round(body: dict[str, Any], expect: int | None) -> int:
    r = _get(body, "round", int)
    if not 0 <= r < 1 << 40:
        raise ProtocolError(f"round {r} out of range")
    if expect is not None and r != expect:
        raise ProtocolError(f"record is for round {r}, expected {expect}")
    return r


def _shard(key: Any, what: str) -> int:
    # msgpack maps are read with string keys only, so shard indices travel as decimal strings
    # canonical decimal only, so one shard has one key: "00", "+1" or non-ASCII digits such as "²" are refused
    if not isinstance(key, str) or not _SHARD_KEY.fullmatch(key) or int(key) >= MAX_SHARDS:
        raise ProtocolError(f"{what}: bad shard index {preview(key, 8)}")
    return int(key)


def _keys(shards: dict[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in shards.items()}


def _digests(value: Any, what: str) -> dict[int, str]:
    if not isinstance(value, dict) or len(value) > MAX_SHARDS:
        raise ProtocolError(f"{what} must map at most {MAX_SHARDS} shards")
    out = {}
    for key, digest in value.items():
        shard = _shard(key, what)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ProtocolError(f"{what}: shard {shard} digest is not 64 hex digits")
        out[shard] = digest
    return out


@dataclass(frozen=True)
class ContribNotice:
    """A replica's notice that its contribution for a round is ready to fetch: digest and size per shard."""

    sender: str
    round: int
    tokens: int
    digests: dict[int, str]  # shard -> sha256 hex of the framed contribution
    sizes: dict[int, int]  # shard -> bytes of the framed contribution
    # False: nobody can dial the sender (behind NAT): it serves its payload only over connections it opened, so it
    # coordinates only after every dialable contributor (hlbp.peer.rounds.rules.coordinator_ranking)
    dialable: bool = True

    def to_body(self, run_id: str) -> dict[str, Any]:
        body = {"run": run_id, "round": self.round, "tokens": self.tokens, "digests": _keys(self.digests),
                "sizes": _keys(self.sizes)}
        if not self.dialable:  # absent means dialable: a dialable peer's notice is the same bytes as before
            body["dialable"] = False
        return body


@dataclass(frozen=True)
class AcceptedSet:
    """The coordinator's list of contributions every in-sync peer applies for a round, in canonical order."""

    coordinator: str
    round: int
    members: tuple[tuple[str, int, dict[int, str]], ...]  # (sender, tokens, shard -> digest), sorted by sender
    banned: tuple[tuple[str, int], ...] = ()  # (sender, until round): garbage senders, so later coordinators skip them
    # the banned senders whose ban is for contributions they announced and did not deliver, sorted: no evidence that
    # anything they sent was false, so a stage peer that received their frames keeps its work (ChainTaint)
    missed: tuple[str, ...] = ()
    # the contributors left out with a chain of frames the coordinator could not take (fed by a peer whose work was
    # withdrawn, computed on other weights or not checked), sorted: each takes that phase out of its error feedback,
    # as a ban's taint would, instead of sending it again in a later round
    dropped: tuple[str, ...] = ()

    def to_body(self, run_id: str) -> dict[str, Any]:
        body = {"run": run_id, "round": self.round, "members": [[s, t, _keys(d)] for s, t, d in self.members],
                "banned": [[p, u] for p, u in self.banned]}
        if self.missed:
            body["missed"] = list(self.missed)
        if self.dropped:
            body["dropped"] = list(self.dropped)
        return body

    def senders(self) -> list[str]:
        return [s for s, _, _ in self.members]

    def faulted(self, r: int) -> list[str]:
        """The peers banned past round ``r`` for something false they sent (not for undelivered contributions),
        sorted."""
        return sorted(p for p, until in self.banned if until > r and p not in self.missed)


@dataclass(frozen=True)
class ShardChecks:
    """A peer's checksums of the shards it holds after applying a round."""

    peer: str
    round: int
    checksums: dict[int, str]
    # shard -> (dot with a fixed sign pattern, L2 norm) in float64: dense all-reduce leaves replicas equal only up to
    # float rounding, so a dense run compares these with a tolerance where a sparse run compares exact checksums
    fingerprints: dict[int, tuple[float, float]] = field(default_factory=dict)
    # the same peer's checksums after the round before (empty: none published, or not carried): a peer's record
    # holds its latest round only, so a member verifying round r late, after the others published r + 1, still
    # reads their votes on r here instead of finding only its own
    previous: dict[int, str] = field(default_factory=dict)

    def to_body(self, run_id: str) -> dict[str, Any]:
        body = {"run": run_id, "round": self.round, "checksums": _keys(self.checksums)}
        if self.fingerprints:
            body["fingerprints"] = {str(k): [float(a), float(b)] for k, (a, b) in self.fingerprints.items()}
        if self.previous:
            body["previous"] = _keys(self.previous)
        return body

    def as_of(self, round_: int) -> ShardChecks | None:
        """This record's vote on round ``round_``: itself when it is of that round, its ``previous`` checksums when
        it is of the round after, else None."""
        if self.round == round_:
            return self
        if self.round == round_ + 1 and self.previous:
            return ShardChecks(self.peer, round_, dict(self.previous))
        return None


def sign(kind: str, body: dict[str, Any], identity: Identity) -> bytes:
    """Seal a round record body with this peer's key."""
    return seal(kind, body, identity)


def _open(data: Any, kind: str, signer: str, run_id: str) -> dict[str, Any]:
    env = open_envelope(data, kind, max_bytes=MAX_RECORD_BYTES, signer=signer)
    if env.body.get("run") != run_id:
        raise ProtocolError(f"{kind} record belongs to another run")
    return env.body


def parse_contrib(data: Any, signer: str, run_id: str, round_: int | None = None) -> ContribNotice:
    body = _open(data, KIND_CONTRIB, signer, run_id)
    r = _round(body, round_)
    tokens = _get(body, "tokens", int)
    if not 0 <= tokens < 1 << 48:
        raise ProtocolError("contribution tokens out of range")
    digests = _digests(body.get("digests"), "contribution digests")
    sizes_raw = body.get("sizes")
    if not isinstance(sizes_raw, dict) or len(sizes_raw) != len(digests):
        raise ProtocolError("contribution sizes must name the same shards as its digests")
    sizes = {}
    for key, size in sizes_raw.items():
        shard = _shard(key, "contribution sizes")
        if shard not in digests:
            raise ProtocolError("contribution sizes must name the same shards as its digests")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"contribution size of shard {shard} out of range")
        sizes[shard] = size
    return ContribNotice(signer, r, tokens, digests, sizes, dialable=_bool(body, "dialable", True))


def parse_accepted(data: Any, signer: str, run_id: str, round_: int | None = None) -> AcceptedSet:
    body = _open(data, KIND_ACCEPTED, signer, run_id)
    r = _round(body, round_)
    raw = _get(body, "members", list)
    if len(raw) > MAX_MEMBERS:
        raise ProtocolError(f"accepted set has more than {MAX_MEMBERS} members")
    members = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError("accepted member must be [sender, tokens, digests]")
        sender, tokens, digests = item
        if not isinstance(sender, str) or not _PEER.fullmatch(sender):
            raise ProtocolError("accepted member sender is not a peer id")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens < 1 << 48:
            raise ProtocolError("accepted member tokens out of range")
        members.append((sender, tokens, _digests(digests, "accepted member digests")))
    senders = [m[0] for m in members]
    if senders != sorted(set(senders)):
        raise ProtocolError("accepted members must be unique and sorted by sender")
    banned_raw = body.get("banned", [])  # absent in records of older peers
    if not isinstance(banned_raw, list) or len(banned_raw) > MAX_MEMBERS:
        raise ProtocolError("accepted set's ban list is malformed")
    banned = []
    for item in banned_raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str) or not _PEER.fullmatch(item[0])
                or not isinstance(item[1], int) or isinstance(item[1], bool) or not r < item[1] <= r + 1024):
            raise ProtocolError("accepted set's ban entry must be [peer id, until round] within 1024 rounds")
        banned.append((item[0], item[1]))
    missed = body.get("missed", [])  # absent in records of older peers: every ban then counts as a fault
    if (not isinstance(missed, list) or not all(isinstance(p, str) for p in missed) or missed != sorted(set(missed))
            or not set(missed) <= {p for p, _ in banned}):
        raise ProtocolError("accepted set's missed list must name banned peers, each once and sorted")
    dropped = body.get("dropped", [])  # absent in records of older peers
    if (not isinstance(dropped, list) or len(dropped) > MAX_MEMBERS
            or not all(isinstance(p, str) and _PEER.fullmatch(p) for p in dropped)
            or dropped != sorted(set(dropped)) or set(dropped) & set(senders)):
        raise ProtocolError("accepted set's dropped list must name peer ids that are no members, each once and "
                            "sorted")
    return AcceptedSet(signer, r, tuple(members), tuple(banned), tuple(missed), tuple(dropped))


def parse_checks(data: Any, signer: str, run_id: str) -> ShardChecks:
    body = _open(data, KIND_CHECKS, signer, run_id)
    checksums = _digests(body.get("checksums"), "checksums")
    raw = body.get("fingerprints", {})  # absent in sparse runs and in records of older peers
    if not isinstance(raw, dict) or len(raw) > MAX_SHARDS:
        raise ProtocolError("checks fingerprints must map at most 256 shards")
    fingerprints = {}
    for key, value in raw.items():
        shard = _shard(key, "checks fingerprints")
        if (shard not in checksums or not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, float) and math.isfinite(v) for v in value) or value[1] < 0):
            raise ProtocolError(f"checks fingerprint of shard {shard} must be [dot, norm >= 0], finite floats")
        fingerprints[shard] = (value[0], value[1])
    previous = _digests(body.get("previous", {}), "previous checksums")  # absent in older peers' records
    r = _round(body, None)
    if previous and r == 0:
        raise ProtocolError("checks of round 0 cannot carry a previous round's")
    return ShardChecks(signer, r, checksums, fingerprints, previous)
