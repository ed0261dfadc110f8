"""A lying hlbp node for the light-client tests: it serves a real snapshot with one record changed in transit.

``python tamper_node.py SOURCE_MADDR PEER_ID`` reads the snapshot of the node at SOURCE_MADDR, changes PEER_ID's
announcement inside its signed body (throughput x1000, the envelope and its old signature kept, so the record is
still well-formed msgpack), and serves the result on ``/hlbp/snapshot/1`` from a py-libp2p host on 127.0.0.1.
It prints ``listening <multiaddr>`` and serves until killed. Like the light client it never imports hivemind.

``--cut-first N`` makes it a flaky node instead: the first N requests get the response header and then a reset
stream, later ones the whole snapshot. A PEER_ID of ``-`` leaves every record as it was.
"""

from __future__ import annotations

import sys

import msgpack
import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol

from hlbp.peer.light.client import SNAPSHOT_PROTOCOL, _read_exactly, fetch_snapshot
from hlbp.protocol.frames import FRAME_PREFIX_BYTES, decode_header, encode_header, header_length
from hlbp.protocol.snapshot import Snapshot, encode_snapshot, parse_snapshot_request


def tamper(envelope: bytes, **changes: object) -> bytes:
    """The envelope with ``changes`` applied to its signed body, re-packed around the original signature."""
    magic, schema, kind, signer, body, signature = msgpack.unpackb(envelope, raw=False)
    fields = msgpack.unpackb(body, raw=False)
    fields.update(changes)
    return msgpack.packb([magic, schema, kind, signer, msgpack.packb(fields, use_bin_type=True), signature],
                         use_bin_type=True)


def tampered_snapshot(source: str, victim: str) -> bytes:
    snap, _ = fetch_snapshot(source, 20)
    if victim == "-":
        return encode_snapshot(snap)
    original = msgpack.unpackb(msgpack.unpackb(snap.peers[victim], raw=False)[4], raw=False)
    peers = {**snap.peers, victim: tamper(snap.peers[victim], throughput=original["throughput"] * 1000 + 1)}
    return encode_snapshot(Snapshot(**{**snap.__dict__, "peers": peers}))


async def serve(body: bytes, cut_first: int) -> None:
    host = new_host(key_pair=create_new_key_pair())
    cuts = [cut_first]

    async def handle(stream: object) -> None:
        length = header_length(await _read_exactly(stream, FRAME_PREFIX_BYTES))
        parse_snapshot_request(decode_header(await _read_exactly(stream, length)))
        if cuts[0] > 0:
            cuts[0] -= 1
            await stream.write(encode_header({"size": len(body)}))
            await stream.reset()
            return
        try:
            await stream.write(encode_header({"size": len(body)}) + body)
        finally:
            await stream.close()

    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.set_stream_handler(TProtocol(SNAPSHOT_PROTOCOL), handle)
        print("listening", f"{host.get_addrs()[0]}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = int(args[args.index("--cut-first") + 1]) if "--cut-first" in args else 0
    trio.run(serve, tampered_snapshot(args[0], args[1]), cut)
