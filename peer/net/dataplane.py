"""The control plane's data-plane handler: artifacts, bandwidth probes and dial-back checks over p2pd streams.

It runs inside the DHT process (hivemind's ``DHT.run_coroutine``), on that process's P2P instance, so serving an
artifact or a probe never takes the main process's time. Requests and responses are explicit msgpack headers with
size limits (:mod:`hlbp.protocol.manifest`), never pickles. :class:`hlbp.peer.net.control.ControlPlane` is the main
process's handle on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from hlbp.peer.net.pace import MIN_FETCH_RATE, SERVE_GRACE_S, read_body, write_body, write_chunks
from hlbp.protocol import ProtocolError
from hlbp.protocol.frames import decode_header, encode_header, header_length, parse_body_size, parse_request
from hlbp.protocol.identity import sha256_hex

logger = logging.getLogger(__name__)

HANDLER_NAME = "/hlbp/control/1"  # the one data-plane handler of the control plane; the header names the op
REQUEST_TIMEOUT_S = 10.0  # a data-plane peer that says nothing for this long is given up on
DIALBACK_TIMEOUT_S = 3.0  # per address, when checking that a peer can be dialled from outside
CHUNK_BYTES = 1 << 16  # probe bodies are written in chunks of this size, with back-pressure between them



_SERVED: dict[str, bytes] = {}  # sha256 -> artifact bytes; lives in the DHT process
_HANDLER_INSTALLED = False


async def _read_header(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    length = header_length(await asyncio.wait_for(reader.readexactly(4), timeout))
    return decode_header(await asyncio.wait_for(reader.readexactly(length), timeout))


async def _dial_back(maddrs: tuple[str, ...], observed: Any) -> tuple[list[str], list[str]]:
    """TCP-connect to the requester's own announced addresses. Only the host the request came from is dialled,
    so this service can't be used to make us connect to third parties."""
    try:
        observed_host = Multiaddr(str(observed)).value_for_protocol("ip4")
    except (MultiaddrError, ValueError, KeyError, TypeError):  # relayed or IPv6: nothing we can check
        observed_host = None
    reachable, unreachable = [], []
    for text in maddrs:
        try:
            addr = Multiaddr(text)
            host, port = addr.value_for_protocol("ip4"), int(addr.value_for_protocol("tcp"))
        except (MultiaddrError, ValueError, KeyError, TypeError):  # not /ip4/../tcp/..: can't test it
            unreachable.append(text)
            continue
        if host != observed_host:
            unreachable.append(text)
            continue
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIALBACK_TIMEOUT_S)
            writer.close()
            reachable.append(text)
        except (TimeoutError, OSError):
            unreachable.append(text)
    return reachable, unreachable


async def _handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        op, arg = parse_request(await _read_header(reader, REQUEST_TIMEOUT_S))
        if op == "artifact":
            data = _SERVED.get(arg)
            if data is None:
                writer.write(encode_header({"error": f"no artifact {arg[:16]}... here"}))
            else:
                writer.write(encode_header({"size": len(data)}))
                await write_body(writer, data, SERVE_GRACE_S, MIN_FETCH_RATE, f"artifact {arg[:12]}…")
        elif op == "probe":
            writer.write(encode_header({"size": arg}))
            zeros = memoryview(bytes(CHUNK_BYTES))
            chunks = (zeros[: min(CHUNK_BYTES, arg - offset)] for offset in range(0, arg, CHUNK_BYTES))
            await write_chunks(writer, chunks, arg, SERVE_GRACE_S, MIN_FETCH_RATE, "a probe")
        else:
            reachable, unreachable = await _dial_back(arg, stream_info.addr)
            writer.write(encode_header({"size": 0, "reachable": reachable, "unreachable": unreachable}))
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
    except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError) as exc:
        logger.debug("data-plane request from %s failed: %s", getattr(stream_info, "peer_id", "?"), exc)
    finally:
        writer.close()


async def install_handler(_dht: Any, node: Any, artifacts: dict[str, str]) -> None:
    """Load artifacts (sha256 -> file path) into the DHT process and install the handler once.

    Paths, not bytes, cross the command pipe: hivemind reads that pipe non-blocking, and a message larger than the
    OS pipe buffer (64 KiB) fails there with EAGAIN and leaves the caller waiting forever.
    """
    global _HANDLER_INSTALLED
    for sha, path in artifacts.items():
        data = Path(path).read_bytes()
        if sha256_hex(data) != sha:
            raise ProtocolError(f"{path} does not hash to {sha[:12]}…; it changed on disk")
        _SERVED[sha] = data
    if not _HANDLER_INSTALLED:
        await node.p2p.add_binary_stream_handler(HANDLER_NAME, _handle)
        _HANDLER_INSTALLED = True


async def watch_parent(_dht: Any, node: Any, parent_pid: int) -> None:
    """Shut the DHT process and its p2pd down when the main process is gone (SIGKILL, crash, OOM killer).

    hivemind's DHT process does not notice its parent dying, so without this an orphaned node would keep serving
    the swarm, and holding memory, forever.
    """
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    logger.warning("the main process %d is gone; shutting this DHT node down", parent_pid)
    await node.shutdown()
    os._exit(0)


async def request_peer(_dht: Any, node: Any, peer_id: str, header: dict[str, Any], max_size: int, timeout: float,
                   save_to: str | None = None, keep_body: bool = True) -> tuple[dict[str, Any], bytes, float]:
    """One data-plane request: (response header, body, seconds from request to last body byte).

    With ``save_to`` the body goes to that file instead (only if it hashes to ``header["sha256"]``); without
    ``keep_body`` it is dropped. Either way large bodies never travel back through hivemind's pipes.
    """
    _, reader, writer = await asyncio.wait_for(
        node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), HANDLER_NAME), timeout)
    try:
        start = time.perf_counter()
        writer.write(encode_header(header))
        await writer.drain()
        response = await _read_header(reader, timeout)
        size = parse_body_size(response, max_size)
        body = await read_body(reader, size, timeout, MIN_FETCH_RATE, f"{header.get('op')} from {peer_id[:12]}…")
        elapsed = time.perf_counter() - start
        if save_to is not None:
            if sha256_hex(body) != header.get("sha256"):
                raise ProtocolError(f"{peer_id} sent bytes that do not match the requested hash")
            partial_path = Path(save_to + ".partial")
            partial_path.parent.mkdir(parents=True, exist_ok=True)
            partial_path.write_bytes(body)
            partial_path.replace(save_to)  # atomic: a half-written artifact never carries its final name
        return response, body if keep_body and save_to is None else b"", elapsed
    finally:
        writer.close()
