"""Signed hlbp records in the DHT: the validator that runs inside the DHT process, the reader that turns raw
entries into verified records, the choice among manifests, and this peer's identity file.

- :class:`RecordValidator` runs inside the DHT process: honest nodes refuse to store an hlbp record that is not
  signed by the peer id it is stored under, so nobody can overwrite another peer's announcement or the manifest.
- :class:`RecordReader` turns raw DHT entries into verified records and logs each bad entry once.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from hlbp.peer.common.errors import UserInputError
from hlbp.protocol import ProtocolError, RecordExpired
from hlbp.protocol.announcement import (
    KIND_ANNOUNCEMENT,
    MAX_ANNOUNCEMENT_BYTES,
    MAX_CLOCK_SKEW_S,
    SignedAnnouncement,
    decode_announcement,
    peers_key,
)
from hlbp.protocol.identity import Identity, open_envelope
from hlbp.protocol.manifest import (
    KIND_MANIFEST,
    MANIFEST_KEY,
    MAX_MANIFEST_BYTES,
    ProtocolVersionMismatch,
    SignedManifest,
    decode_manifest,
)
from hlbp.protocol.snapshot import choose_manifest  # noqa: F401 - re-exported: the control plane's choice too

logger = logging.getLogger(__name__)

MANIFEST_DHT_TTL_MAX_S = 24 * 3600.0  # nobody may pin a manifest in the DHT for longer than this


def dht_time() -> float:
    """The DHT's clock: wall-clock seconds, as every record's issued_at and expires_at use."""
    return get_dht_time()


class LogOnce:
    """Logs a message the first time its key is seen; remembers the last ``capacity`` keys.

    A bad record stays in the DHT until it expires and is read again on every heartbeat, so per-read logging
    would flood the log with the same line.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()

    def __call__(self, key: str, level: int, message: str, *args: Any) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        logger.log(level, message, *args)
        return True


def _entry_key(subkey: Any, value: Any) -> str:
    return hashlib.sha256(repr((subkey, value)).encode(errors="replace")).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Identity files
# ---------------------------------------------------------------------------------------------------------------


def load_or_create_identity(path: Path) -> Identity:
    """Read the Ed25519 identity at ``path``, or create it (mode 0400) if it does not exist yet.

    The same file is p2pd's ``-id``, so the peer id in the multiaddr and the record signer are one key.
    """
    path = Path(path).expanduser()
    if path.exists():
        try:
            return Identity.from_file_bytes(path.read_bytes())
        except OSError as exc:
            raise UserInputError(f"cannot read identity file {path}: {exc.strerror}") from None
        except ProtocolError as exc:
            raise UserInputError(
                f"{path}: {exc}. hlbp identities are Ed25519 keys; move this file away to create a new one"
            ) from None
    identity = Identity.generate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: two processes racing to create the same identity must not both believe they own it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_file_bytes())
    except OSError as exc:
        raise UserInputError(f"cannot create identity file {path}: {exc.strerror}") from None
    logger.info("created identity %s for peer %s", path, identity.peer_id)
    return identity


# ---------------------------------------------------------------------------------------------------------------
# Record validation inside the DHT, and verification for readers
# ---------------------------------------------------------------------------------------------------------------


def _dht_key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def record_validator(run_ids: tuple[str, ...] = (), extra: dict[str, tuple[str, int]] | None = None
                     ) -> RecordValidator:
    """A DHT validator protecting the manifest key, the peers keys of ``run_ids``, and ``extra`` keys
    (DHT key -> (record kind, max envelope bytes)), e.g. a round's record keys."""
    keys = {_dht_key_id(MANIFEST_KEY): (KIND_MANIFEST, MAX_MANIFEST_BYTES)}
    keys.update({_dht_key_id(peers_key(r)): (KIND_ANNOUNCEMENT, MAX_ANNOUNCEMENT_BYTES) for r in run_ids})
    keys.update({_dht_key_id(key): spec for key, spec in (extra or {}).items()})
    return RecordValidator(keys)


class RecordValidator(RecordValidatorBase):
    """Accepts an hlbp record only if its envelope is signed by the peer id it is stored under.

    Keys that are not hlbp's pass untouched, so a plain hivemind DHT can share the network. The body schema is
    checked by readers, not here: a manifest of a newer protocol version must still reach peers, who then refuse
    it with a message instead of silently finding nothing.

    Readers need it as much as writers: hivemind keeps, per subkey, the answer with the latest expiration, so
    without validation a forged entry stored with a later expiration would shadow the real record.
    """

    def __init__(self, keys: dict[bytes, tuple[str, int]]) -> None:
        self.keys = dict(keys)
        self.log_once = LogOnce()

    def validate(self, record: DHTRecord) -> bool:
        spec = self.keys.get(record.key)
        if spec is None:
            return True
        kind, limit = spec
        try:
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
            except (ValueError, TypeError):  # a forger can put any bytes here
                raise ProtocolError("not msgpack") from None
            if not isinstance(subkey, str):
                raise ProtocolError("hlbp records are stored under a peer id subkey")
            env = open_envelope(value, kind, max_bytes=limit, signer=subkey)
            if kind == KIND_MANIFEST:
                if record.expiration_time > dht_time() + MANIFEST_DHT_TTL_MAX_S:
                    raise ProtocolError("manifest stored with a too distant expiration")
            elif kind == KIND_ANNOUNCEMENT:
                expires_at = env.body.get("expires_at")
                if not isinstance(expires_at, (int, float)) or record.expiration_time > expires_at + MAX_CLOCK_SKEW_S:
                    raise ProtocolError("announcement stored to outlive its signed expiry")
            return True
        except ProtocolError as exc:
            self.log_once(_entry_key(record.subkey, record.value), logging.WARNING,
                          "DHT refused an hlbp %s record: %s", kind, exc)
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if isinstance(other, RecordValidator):
            self.keys.update(other.keys)
            return True
        return False


class RecordReader:
    """Turns raw DHT entries into verified records. Bad entries are skipped and logged once each."""

    def __init__(self) -> None:
        self.log_once = LogOnce()

    def manifests(self, entries: dict[Any, Any]) -> tuple[list[SignedManifest], dict[str, ProtocolVersionMismatch]]:
        """Valid manifests, and by signer the well-signed ones of another protocol version (so a joiner can say
        why it refuses the run instead of reporting that it found none)."""
        found: list[SignedManifest] = []
        mismatches: dict[str, ProtocolVersionMismatch] = {}
        for subkey, item in list(entries.items())[:64]:
            value = getattr(item, "value", item)
            try:
                if not isinstance(subkey, str):
                    raise ProtocolError("subkey is not a peer id")
                found.append(decode_manifest(value, signer=subkey))
            except ProtocolVersionMismatch as exc:
                mismatches[subkey] = exc
                self.log_once(_entry_key(subkey, value), logging.WARNING, "ignoring a manifest record: %s", exc)
            except ProtocolError as exc:
                self.log_once(_entry_key(subkey, value), logging.WARNING, "ignoring a manifest record: %s", exc)
        return found, mismatches

    def announcements(self, entries: dict[Any, Any], run_id: str, now: float) -> dict[str, SignedAnnouncement]:
        """Valid, unexpired announcements of ``run_id`` by peer id; offline ones are kept (status shows them)."""
        out: dict[str, SignedAnnouncement] = {}
        for subkey, item in list(entries.items())[:4096]:
            value = getattr(item, "value", item)
            try:
                if not isinstance(subkey, str):
                    raise ProtocolError("subkey is not a peer id")
                out[subkey] = decode_announcement(value, now=now, signer=subkey, run_id=run_id)
            except RecordExpired:
                continue  # expiry is the normal end of a record, not an attack
            except ProtocolError as exc:
                self.log_once(_entry_key(subkey, value), logging.WARNING, "ignoring a peer record: %s", exc)
        return out
