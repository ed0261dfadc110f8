"""The light client's network shell: dial one hlbp node over py-libp2p (trio), ask for a snapshot or an artifact.

Each call starts a py-libp2p host with a fresh Ed25519 key that listens nowhere, dials the peer of one multiaddr
(the noise handshake proves the peer id in its ``/p2p/`` part), opens one stream, and stops the host. Requests and
responses use the data-plane frames every hlbp node speaks (:mod:`hlbp.protocol.frames`): the snapshot on
``/hlbp/snapshot/1``, artifacts by hash on ``/hlbp/control/1``. Everything read is bounded before it is
allocated; a peer that breaks the protocol raises :class:`ProtocolError`, one that cannot be reached raises
:class:`LightDialError`.

Nothing here verifies a record: :func:`hlbp.protocol.snapshot.verify_snapshot` does that for the caller.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlbp.peer.common.errors import UserInputError
from hlbp.protocol import ProtocolError
from hlbp.protocol.frames import (
    FRAME_PREFIX_BYTES,
    decode_header,
    encode_header,
    header_length,
    parse_body_size,
)
from hlbp.protocol.manifest import MAX_ARTIFACT_BYTES
from hlbp.protocol.snapshot import MAX_SNAPSHOT_BYTES, Snapshot, decode_snapshot, snapshot_request

SNAPSHOT_PROTOCOL = "/hlbp/snapshot/1"  # hlbp.peer.net.snapshot.SNAPSHOT_HANDLER
CONTROL_PROTOCOL = "/hlbp/control/1"  # hlbp.peer.net.dataplane.HANDLER_NAME
READ_CHUNK = 1 << 16
ATTEMPTS = 2  # dials per request: a stream cut mid-answer is asked once more, on a new connection
RETRY_PAUSE_S = 0.5
_INSTALL_HINT = "the light client needs py-libp2p: pip install 'hlbp[libp2p]'"


class LightDialError(UserInputError):
    """The peer could not be reached, did not answer in time, or does not speak the protocol."""


class StreamCut(ProtocolError):
    """The peer closed or reset the stream before its answer was complete.

    A loaded node or a dropped connection does this as well as a liar, so one fresh dial is tried again
    (:data:`ATTEMPTS`) before the peer is reported.
    """


@dataclass(frozen=True)
class Fetched:
    """What one request brought back, and how long it took."""

    peer_id: str  # the dialled peer, as its noise handshake proved
    seconds: float  # from starting the host to the last byte
    size: int  # body bytes received


def _leaf(exc: BaseException) -> BaseException:
    """The innermost error under trio's exception groups, py-libp2p's MultiError and ``raise ... from`` chains:
    the one that says what happened (``Connection refused``), not where."""
    for _ in range(32):
        inner = list(getattr(exc, "exceptions", ()) or ()) + list(getattr(exc, "errors", ()) or ())
        nxt = inner[0] if inner else exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def _first(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first error of one of ``kinds`` inside ``exc``'s exception groups (depth-first), if any."""
    stack = [exc]
    while stack:
        item = stack.pop(0)
        if isinstance(item, kinds):
            return item
        stack.extend(getattr(item, "exceptions", ()) or ())
    return None


def _describe(exc: BaseException) -> str:
    leaf = _leaf(exc)
    text = " ".join(str(leaf).split())
    return f"{type(leaf).__name__}: {text}"[:160] if text else type(leaf).__name__


async def _read_exactly(stream: Any, n: int, sink: Callable[[bytes], None] | None = None) -> bytes:
    """Exactly ``n`` bytes from a py-libp2p stream (``read`` returns what has arrived); with ``sink`` the bytes go
    there in chunks instead of into memory."""
    buf = bytearray()
    got = 0
    while got < n:
        try:
            chunk = await stream.read(min(READ_CHUNK, n - got))
        except Exception as exc:  # noqa: BLE001 - StreamEOF, StreamReset, ... all mean: the peer stopped sending
            raise StreamCut(f"the peer closed the stream after {got} of {n} bytes ({type(exc).__name__})") from None
        if not chunk:
            raise StreamCut(f"the peer closed the stream after {got} of {n} bytes")
        got += len(chunk)
        if sink is None:
            buf += chunk
        else:
            sink(chunk)
    return bytes(buf)


async def _read_response_header(stream: Any, max_size: int) -> int:
    length = header_length(await _read_exactly(stream, FRAME_PREFIX_BYTES))
    return parse_body_size(decode_header(await _read_exactly(stream, length)), max_size)


def _run(maddr: str, protocol: str, timeout_s: float, exchange: Callable[[Any], Awaitable[Any]]) -> tuple[Any, str]:
    """Dial ``maddr``, open one ``protocol`` stream, run ``exchange(stream)``; returns (its result, peer id)."""
    try:
        import multiaddr
        import trio
        from libp2p import new_host
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.custom_types import TProtocol
        from libp2p.network.config import ConnectionConfig
        from libp2p.peer.peerinfo import info_from_p2p_addr
    except ImportError:
        raise UserInputError(_INSTALL_HINT) from None
    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
    except Exception:  # noqa: BLE001 - multiaddr raises its own zoo of errors for a typo
        raise UserInputError(f"{maddr!r} is not a full multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; "
                             "copy the address that `hlbp bootstrap` printed, including the /p2p/ part") from None
    stage = ["dial"]
    # Failures come back as one line from this module; py-libp2p would also log each failed attempt.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)

    async def main() -> Any:
        # One connection per peer: py-libp2p otherwise waits out a 250 ms "happy eyeballs" head start after a
        # dial that already succeeded, hoping for a second connection.
        host = new_host(key_pair=create_new_key_pair(), connection_config=ConnectionConfig(max_connections_per_peer=1))
        async with host.run(listen_addrs=[]):
            with trio.fail_after(timeout_s):
                await host.connect(info)
                stage[0] = "open a stream to"
                stream = await host.new_stream(info.peer_id, [TProtocol(protocol)])
                stage[0] = "talk to"
                try:
                    return await exchange(stream)
                finally:
                    with trio.move_on_after(1):
                        await stream.close()

    try:
        return trio.run(main), str(info.peer_id)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - trio wraps everything in exception groups; sort it out here
        mine = _first(exc, (ProtocolError, UserInputError))
        if mine is not None:
            raise mine from None
        if _first(exc, (trio.TooSlowError,)) is not None:
            raise LightDialError(f"no answer from {maddr} within {timeout_s:g} s (could not {stage[0]} it); "
                                 "check the address, or raise --connect-timeout") from None
        if stage[0] == "open a stream to":
            raise LightDialError(f"{maddr} does not serve {protocol} ({_describe(exc)}); is it an hlbp node "
                                 "of this version?") from None
        raise LightDialError(f"could not {stage[0]} {maddr} over py-libp2p ({_describe(exc)}); is the peer "
                             "running, and is this the address it printed?") from None


def _again_if_cut(attempt: Callable[[], Any]) -> Any:
    """``attempt()``, called again after a pause if the peer cut its stream short; the last cut is raised with the
    number of tries in its message."""
    for _ in range(ATTEMPTS - 1):
        try:
            return attempt()
        except StreamCut:
            time.sleep(RETRY_PAUSE_S)
    try:
        return attempt()
    except StreamCut as exc:
        raise StreamCut(f"{exc}, on each of {ATTEMPTS} tries") from None


def fetch_snapshot(maddr: str, timeout_s: float = 10.0) -> tuple[Snapshot, Fetched]:
    """The snapshot that the node at ``maddr`` serves (shape checked, records not yet verified)."""
    return _again_if_cut(lambda: _fetch_snapshot_once(maddr, timeout_s))


def _fetch_snapshot_once(maddr: str, timeout_s: float) -> tuple[Snapshot, Fetched]:
    start = time.perf_counter()

    async def exchange(stream: Any) -> bytes:
        await stream.write(encode_header(snapshot_request()))
        size = await _read_response_header(stream, MAX_SNAPSHOT_BYTES)
        return await _read_exactly(stream, size)

    body, peer_id = _run(maddr, SNAPSHOT_PROTOCOL, timeout_s, exchange)
    return decode_snapshot(body), Fetched(peer_id, time.perf_counter() - start, len(body))


def fetch_artifact(maddr: str, sha256: str, size: int, dest: Path, timeout_s: float = 60.0) -> Fetched:
    """Download the artifact ``sha256`` (at most ``size`` bytes) from the node at ``maddr`` into ``dest``.

    The body streams into ``dest``'s ``.partial`` file while it is hashed; only bytes that hash to ``sha256`` are
    renamed to ``dest``, so a wrong or cut-short download never carries the final name.
    """
    if not 0 <= size <= MAX_ARTIFACT_BYTES:
        raise ProtocolError(f"an artifact of {size} bytes is over the {MAX_ARTIFACT_BYTES}-byte limit")
    return _again_if_cut(lambda: _fetch_artifact_once(maddr, sha256, size, Path(dest), timeout_s))


def _fetch_artifact_once(maddr: str, sha256: str, size: int, dest: Path, timeout_s: float) -> Fetched:
    partial = dest.with_name(dest.name + ".partial")
    start = time.perf_counter()

    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as f:

            def sink(chunk: bytes) -> None:
                digest.update(chunk)
                f.write(chunk)

            async def exchange(stream: Any) -> int:
                await stream.write(encode_header({"op": "artifact", "sha256": sha256}))
                n = await _read_response_header(stream, size)
                await _read_exactly(stream, n, sink)
                if digest.hexdigest() != sha256:
                    raise ProtocolError(f"the peer sent {n} bytes that do not hash to {sha256[:12]}…; nothing was "
                                        "saved")
                return n

            n, peer_id = _run(maddr, CONTROL_PROTOCOL, timeout_s, exchange)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)
    return Fetched(peer_id, time.perf_counter() - start, n)
