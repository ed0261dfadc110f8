"""The control plane of one node: DHT connection, signed records, heartbeats, and run artifacts by hash.

- :func:`connect_dht` starts a hivemind DHT whose p2pd uses this peer's Ed25519 identity, retrying the initial
  peers with exponential backoff and failing with every address tried and what to check.
- :class:`RecordValidator` runs inside the DHT process: honest nodes refuse to store an hlbp record that is not
  signed by the peer id it is stored under, so nobody can overwrite another peer's announcement or the manifest.
- :class:`RecordReader` turns raw DHT entries into verified records and logs each bad entry once.
- :class:`ControlPlane` wraps the DHT for the main process: publish and read records, serve and fetch artifacts,
  probe bandwidth and ask a peer to dial us back. Data-plane requests run in the DHT process's event loop, over
  one raw hivemind stream handler: a length-prefixed msgpack header, then the body (hlbp.protocol.records).
- :class:`Heartbeat` refreshes this peer's announcement before it expires and marks it offline on leave.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.net.dataplane import (
    DIALBACK_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    install_handler,
    request_peer,
    watch_parent,
)
from hlbp.peer.net.dht import DHT_DIED, SafeDHT
from hlbp.protocol import ProtocolError
from hlbp.protocol.identity import Identity, open_envelope, sha256_hex
from hlbp.protocol.records import (
    KIND_ANNOUNCEMENT,
    KIND_MANIFEST,
    MANIFEST_KEY,
    MAX_ANNOUNCEMENT_BYTES,
    MAX_CLOCK_SKEW_S,
    MAX_MANIFEST_BYTES,
    MAX_PROBE_BYTES,
    Announcement,
    Artifact,
    ProtocolVersionMismatch,
    SignedAnnouncement,
    SignedManifest,
    decode_announcement,
    decode_manifest,
    encode_announcement,
    peers_key,
)

logger = logging.getLogger(__name__)

MANIFEST_DHT_TTL_MAX_S = 24 * 3600.0  # nobody may pin a manifest in the DHT for longer than this
LEAVE_TIMEOUT_S = 5.0  # SIGTERM must end a peer within seconds, even when the DHT no longer answers


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def software_version() -> str:
    """The installed hlbp version, announced so that status can show who runs what."""
    try:
        return version("hlbp")
    except PackageNotFoundError:
        return "unknown"


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
            except ProtocolError as exc:
                if "expired" in str(exc):
                    continue  # expiry is the normal end of a record, not an attack
                self.log_once(_entry_key(subkey, value), logging.WARNING, "ignoring a peer record: %s", exc)
        return out


def choose_manifest(manifests: list[SignedManifest], trusted: set[str]) -> SignedManifest | None:
    """The newest manifest among those signed by a trusted peer id (ties: smallest signer, for determinism)."""
    candidates = [m for m in manifests if m.signer in trusted]
    if not candidates:
        return None
    return max(candidates, key=lambda m: (m.manifest.issued_at, [-ord(c) for c in m.signer]))


# ---------------------------------------------------------------------------------------------------------------
# DHT connection
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class NetworkConfig:
    """How this node attaches to the swarm."""

    initial_peers: list[str] = field(default_factory=list)  # full multiaddrs with /p2p/<peer id>
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # where p2pd listens
    announce_maddrs: list[str] = field(default_factory=list)  # public addresses others should dial, if not seen
    client_mode: bool = False  # DHT client: dials out, serves no DHT requests (for peers others can't dial)
    connect_timeout_s: float = 60.0  # total time spent retrying the initial peers
    nat_port_map: bool = False  # ask the router for a port mapping (UPnP/NAT-PMP); off: it talks to the LAN


def check_initial_peers(maddrs: list[str]) -> list[str]:
    """Parse every initial peer up front: a typo is a user error, not something to retry for a minute."""
    good = []
    for text in maddrs:
        text = text.strip()
        if not text:
            continue
        try:
            addr = Multiaddr(text)
            addr["p2p"]
        except (MultiaddrError, ValueError, KeyError, TypeError):  # KeyError: no /p2p/ part
            raise UserInputError(
                f"initial peer {text!r} is not a full multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; "
                "copy the address that `hlbp bootstrap` printed, including the /p2p/ part"
            ) from None
        good.append(text)
    return good


def connect_dht(net: NetworkConfig, identity_path: Path, validator: Any,
                sleep: Callable[[float], None] = time.sleep) -> Any:
    """Start a hivemind DHT and join through ``net.initial_peers``, retrying with exponential backoff.

    Raises UserInputError naming every address tried and what usually fixes it.
    """
    peers = check_initial_peers(net.initial_peers)
    kwargs = {
        "host_maddrs": net.host_maddrs,
        "announce_maddrs": net.announce_maddrs or None,
        "identity_path": str(identity_path),
        "client_mode": net.client_mode,
        "nat_port_map": net.nat_port_map,
        # hivemind's check assumes RSA identities and spawns an extra daemon; our keys are per-peer files
        "check_if_identity_free": False,
        "record_validators": [validator],
    }
    deadline = time.monotonic() + net.connect_timeout_s
    delay, attempts, last_error = 0.5, 0, ""
    while True:
        attempts += 1
        try:
            return SafeDHT(initial_peers=peers or None, start=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - hivemind raises P2PDaemonError, RuntimeError, ValueError, ...
            last_error = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
            if not peers:
                raise UserInputError(f"could not start the DHT node on {net.host_maddrs}: {last_error}") from None
        if time.monotonic() + delay > deadline:
            break
        logger.warning("no initial peer answered (attempt %d: %s); retrying in %.1f s", attempts, last_error, delay)
        sleep(delay)
        delay = min(delay * 2, 8.0)
    tried = "\n".join(f"  {p}" for p in peers)
    raise UserInputError(
        f"could not join the swarm after {attempts} attempts in {net.connect_timeout_s:.0f} s. Tried:\n{tried}\n"
        f"last error: {last_error}\n"
        "Check that: the bootstrap is running and printed exactly this address; its TCP port is open in its "
        "firewall; the /p2p/ peer id matches (it changes when the bootstrap's --identity file changes); from "
        "another machine you use the bootstrap's public address, not 127.0.0.1. Raise --connect-timeout to "
        "wait longer."
    )


# ---------------------------------------------------------------------------------------------------------------
# The main-process view
# ---------------------------------------------------------------------------------------------------------------


class ControlPlane:
    """One node's DHT and data-plane handle, safe to use from several threads."""

    def __init__(self, dht: Any, identity: Identity) -> None:
        self.dht = dht
        self.identity = identity
        self.peer_id = identity.peer_id
        self.reader = RecordReader()
        self._watched: set[str] = set()

    @classmethod
    def connect(cls, net: NetworkConfig, identity_path: Path, run_ids: tuple[str, ...] = (),
                identity: Identity | None = None) -> ControlPlane:
        identity = identity or load_or_create_identity(identity_path)
        dht = connect_dht(net, identity_path, record_validator(run_ids))
        plane = cls(dht, identity)
        plane._watched.update(run_ids)
        dht.run_coroutine(partial(watch_parent, parent_pid=os.getpid()), return_future=True)
        if str(dht.peer_id) != identity.peer_id:
            plane.shutdown()
            raise UserInputError(f"p2pd runs as {dht.peer_id}, not {identity.peer_id} from {identity_path}")
        return plane

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        if not self.dht.is_alive():
            raise ConnectionError(DHT_DIED)
        future = getattr(self.dht, method)(*args, return_future=True, **kwargs)
        return future.result(timeout=timeout)

    def run_coroutine(self, coro: Callable[..., Any], timeout: float = 60.0) -> Any:
        return self._call("run_coroutine", coro, timeout=timeout)

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def watch_run(self, run_id: str) -> None:
        """Validate the run's peers key in our DHT node: refuse forged records, and drop forged answers."""
        self.dht.add_validators([record_validator((run_id,))])
        self._watched.add(run_id)

    def protect(self, keys: dict[str, tuple[str, int]]) -> None:
        """Validate more keys (DHT key -> (record kind, max envelope bytes)) the same way, e.g. a round's."""
        self.dht.add_validators([record_validator(extra=keys)])

    def shutdown(self) -> None:
        self.dht.shutdown()

    # -- records -------------------------------------------------------------------------------------------------

    def publish_manifest(self, envelope: bytes, signer: str, ttl: float) -> bool:
        return bool(self._call("store", MANIFEST_KEY, envelope, dht_time() + ttl, subkey=signer))

    def read_manifests(self) -> tuple[list[SignedManifest], dict[str, ProtocolVersionMismatch]]:
        found = self._call("get", MANIFEST_KEY, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        return self.reader.manifests(entries)

    def manifest_expiry(self, signer: str) -> float | None:
        """When the DHT will drop ``signer``'s manifest, or None if it holds none."""
        found = self._call("get", MANIFEST_KEY, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        entry = entries.get(signer)
        return getattr(entry, "expiration_time", None)

    def announce(self, announcement: Announcement, timeout: float = 30.0) -> int:
        """Store this peer's signed announcement until its expiry; returns the record size in bytes."""
        data = encode_announcement(announcement, self.identity)
        ok = self._call("store", peers_key(announcement.run_id), data, announcement.expires_at, subkey=self.peer_id,
                        timeout=timeout)
        if not ok:
            logger.warning("no DHT node accepted this peer's record; it will retry at the next heartbeat")
        return len(data)

    def read_peers(self, run_id: str) -> dict[str, SignedAnnouncement]:
        """Verified records of the run's peers. The first read also installs the run's validator in our DHT node:
        without it, a forged entry with a later expiration would shadow the real record of that peer."""
        if run_id not in self._watched:
            self.watch_run(run_id)
        found = self._call("get", peers_key(run_id), latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        return self.reader.announcements(entries, run_id, dht_time())

    def find_manifest(self, anchors: set[str], explicit_signers: bool, deadline_s: float,
                      poll_s: float = 0.5) -> SignedManifest:
        """Wait up to ``deadline_s`` for a manifest signed by a trusted peer.

        Trusted: the ``anchors`` (the initial peers' ids, or the --manifest-signer ids). Unless the signers were
        given explicitly, a signer named by an anchor's own announcement is trusted too, so a joiner can enter
        through any live peer after the bootstrap is gone.
        """
        end = time.monotonic() + deadline_s
        while True:
            manifests, mismatches = self.read_manifests()
            trusted = set(anchors)
            if not explicit_signers:
                for run_id in sorted({m.manifest.run_id for m in manifests})[:8]:
                    peers = self.read_peers(run_id)
                    trusted |= {peers[a].announcement.manifest_signer for a in anchors if a in peers}
            chosen = choose_manifest(manifests, trusted)
            if chosen is not None:
                return chosen
            refused = [exc for signer, exc in mismatches.items() if signer in trusted]
            if refused:
                raise UserInputError(str(refused[0]))
            if time.monotonic() > end:
                break
            time.sleep(poll_s)  # a poll interval while the manifest propagates, bounded by the deadline
        raise UserInputError(
            f"no run manifest signed by {', '.join(sorted(anchors)) or 'a trusted peer'} appeared in the DHT within "
            f"{deadline_s:.0f} s. Is `hlbp bootstrap` running? If you joined through a peer other than the "
            "bootstrap, pass --manifest-signer <bootstrap peer id>."
        )

    # -- data plane ----------------------------------------------------------------------------------------------

    def serve_artifacts(self, artifacts: dict[str, Path]) -> None:
        """Serve these artifacts (sha256 -> file) and the probe and dial-back requests from now on."""
        artifacts = {sha: str(Path(path).resolve()) for sha, path in artifacts.items()}
        self.run_coroutine(partial(install_handler, artifacts=artifacts))

    def request(self, peer_id: str, header: dict[str, Any], max_size: int, timeout: float = REQUEST_TIMEOUT_S,
                save_to: Path | None = None, keep_body: bool = True) -> tuple[dict[str, Any], bytes, float]:
        return self.run_coroutine(
            partial(request_peer, peer_id=peer_id, header=header, max_size=max_size, timeout=timeout,
                    save_to=None if save_to is None else str(Path(save_to).resolve()), keep_body=keep_body),
            timeout=timeout * 3 + 5,
        )

    def fetch_artifact(self, artifact: Artifact, sources: list[str], dest: Path) -> Path:
        """Download ``artifact`` to ``dest`` from the first source whose bytes have the right hash."""
        errors = []
        for peer_id in sources:
            try:
                self.request(peer_id, {"op": "artifact", "sha256": artifact.sha256}, artifact.size, save_to=dest)
            except Exception as exc:  # noqa: BLE001 - any failure of one source means: try the next one
                errors.append(f"{peer_id[:16]}…: {_describe(exc)[:120]}")
                logger.warning("could not fetch %s from %s (%s); trying another peer", artifact.name, peer_id, exc)
                continue
            if sha256_hex(Path(dest).read_bytes()) == artifact.sha256:
                return Path(dest)
            errors.append(f"{peer_id[:16]}…: the saved file does not match its hash")
        raise UserInputError(f"could not fetch {artifact.name} ({artifact.sha256[:12]}…) from any peer: "
                             + "; ".join(errors or ["no peer announces it"]))

    def probe(self, peer_id: str, n_bytes: int) -> float:
        """Seconds to download ``n_bytes`` from ``peer_id`` over a data-plane stream."""
        n_bytes = min(n_bytes, MAX_PROBE_BYTES)
        response, _, seconds = self.request(peer_id, {"op": "probe", "bytes": n_bytes}, n_bytes, keep_body=False)
        if response.get("size") != n_bytes:
            raise ProtocolError("the probe answer has the wrong length")
        return seconds

    def dial_back(self, peer_id: str, maddrs: list[str]) -> tuple[list[str], list[str]]:
        """Ask ``peer_id`` to open a TCP connection to our own addresses: (reachable, unreachable)."""
        header, _, _ = self.request(peer_id, {"op": "dialback", "maddrs": maddrs[:8]}, 0,
                                    timeout=DIALBACK_TIMEOUT_S * len(maddrs[:8]) + REQUEST_TIMEOUT_S)
        reachable, unreachable = header.get("reachable", []), header.get("unreachable", [])
        if not (isinstance(reachable, list) and isinstance(unreachable, list)):
            raise ProtocolError("malformed dial-back response")
        return [str(a) for a in reachable], [str(a) for a in unreachable]


# ---------------------------------------------------------------------------------------------------------------
# Heartbeat
# ---------------------------------------------------------------------------------------------------------------


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
