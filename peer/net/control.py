"""The control plane of one node: DHT connection, publishing and reading records, and run artifacts by hash.

- :func:`connect_dht` starts a hivemind DHT whose p2pd uses this peer's Ed25519 identity, retrying the initial
  peers with exponential backoff and failing with every address tried and what to check.
- The records themselves are verified by :mod:`hlbp.peer.net.validation` (inside the DHT process and by readers).
- :class:`ControlPlane` wraps the DHT for the main process: publish and read records, serve and fetch artifacts,
  probe bandwidth and ask a peer to dial us back. Data-plane requests run in the DHT process's event loop, over
  one raw hivemind stream handler: a length-prefixed msgpack header, then the body (hlbp.protocol.manifest).
- :class:`hlbp.peer.net.heartbeat.Heartbeat` refreshes this peer's announcement before it expires.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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
from hlbp.peer.net.pace import MIN_FETCH_RATE, body_due
from hlbp.peer.net.validation import (
    RecordReader,
    choose_manifest,
    dht_time,
    load_or_create_identity,
    record_validator,
)
from hlbp.protocol import ProtocolError
from hlbp.protocol.announcement import Announcement, SignedAnnouncement, encode_announcement, peers_key
from hlbp.protocol.identity import Identity, sha256_hex
from hlbp.protocol.manifest import (
    MANIFEST_KEY,
    MAX_PROBE_BYTES,
    Artifact,
    ProtocolVersionMismatch,
    SignedManifest,
)

logger = logging.getLogger(__name__)



def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def software_version() -> str:
    """The installed hlbp version, announced so that status can show who runs what."""
    try:
        return version("hlbp")
    except PackageNotFoundError:
        return "unknown"


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


def check_ports_free(host_maddrs: list[str]) -> None:
    """Raise UserInputError when a TCP port that ``host_maddrs`` names explicitly is already taken on its address.

    p2pd does not fail when one of its listen addresses cannot be bound: it listens on the others (or on nothing
    useful) and the node starts as if all were well, unreachable at the address its operator printed. Binding the
    port ourselves first turns that into one clear line. Port 0 (any free port) and non-TCP addresses are left to
    the daemon.
    """
    for text in host_maddrs:
        parts = text.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or not parts[3].isdigit():
            continue
        host, port = parts[1], int(parts[3])
        if port == 0:
            continue
        family = socket.AF_INET6 if parts[0] == "ip6" else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # as the daemon binds: a port left in TIME_WAIT by a peer that just restarted is free, a listener is not
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UserInputError(f"TCP port {port} on {host} is already in use by another process; stop it "
                                         "or listen on another port (--host-maddrs)") from None
                raise UserInputError(f"cannot listen on {text}: {exc.strerror or exc}") from None


def connect_dht(net: NetworkConfig, identity_path: Path, validator: Any,
                sleep: Callable[[float], None] = time.sleep) -> Any:
    """Start a hivemind DHT and join through ``net.initial_peers``, retrying with exponential backoff.

    Raises UserInputError naming every address tried and what usually fixes it.
    """
    peers = check_initial_peers(net.initial_peers)
    check_ports_free(list(net.host_maddrs))
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

    def __init__(self, dht: Any, identity: Identity, watched: tuple[str, ...] = ()) -> None:
        self.dht = dht
        self.identity = identity
        self.peer_id = identity.peer_id
        self.reader = RecordReader()
        self._watched: set[str] = set(watched)  # runs whose records our DHT node's validator checks

    @classmethod
    def connect(cls, net: NetworkConfig, identity_path: Path, run_ids: tuple[str, ...] = (),
                identity: Identity | None = None) -> ControlPlane:
        identity = identity or load_or_create_identity(identity_path)
        dht = connect_dht(net, identity_path, record_validator(run_ids))
        plane = cls(dht, identity, run_ids)
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

    def serve_snapshot(self, run_id: str) -> None:
        """Serve the run's signed records to light clients from now on (:mod:`hlbp.peer.net.snapshot`)."""
        from hlbp.peer.net.snapshot import install_snapshot_handler

        self.run_coroutine(partial(install_snapshot_handler, run_id=run_id))

    def request(self, peer_id: str, header: dict[str, Any], max_size: int, timeout: float = REQUEST_TIMEOUT_S,
                save_to: Path | None = None, keep_body: bool = True) -> tuple[dict[str, Any], bytes, float]:
        return self.run_coroutine(
            partial(request_peer, peer_id=peer_id, header=header, max_size=max_size, timeout=timeout,
                    save_to=None if save_to is None else str(Path(save_to).resolve()), keep_body=keep_body),
            # a backstop only: the request keeps its own time (the timeout, then the body's pace)
            timeout=body_due(0.0, timeout * 3 + 5, max_size, MIN_FETCH_RATE),
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


