"""Bundles: others' signed round records passed on in one push (the committee's forwards and relays).

A committee member forwards the notices of its part to the leads, and relays the accepted set with its members'
notices to the peers whose notices it holds (:mod:`hlbp.peer.rounds.committee`). Each record in a bundle keeps its
signer's seal, and the receiver parses it exactly as if the signer had pushed or stored it, signature included, so
a bundle vouches for nothing: whoever sends one can only pass on records that the DHT would give anyway. The bundle
itself is plain canonical msgpack ``{"round": int, "complete": bool, "records": [[kind, signer, bytes], ...]}``;
``complete`` says the sender's part holds every notice it expected. Decoding raises :class:`ProtocolError` for
anything else and checks every size before it allocates.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.untrusted import unpack_msgpack

BUNDLE_KINDS = frozenset({"contrib", "accepted"})  # what a bundle may carry
MAX_BUNDLE_BYTES = 60 * 1024  # below the transport's 64 KiB push limit
MAX_BUNDLE_RECORDS = 256
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")


@dataclass(frozen=True)
class Bundle:
    """A decoded bundle: its ``round``, whether the sender's part was ``complete``, and the ``records`` it
    carries as (kind, signer, signed bytes), not yet verified."""

    round: int
    complete: bool
    records: tuple[tuple[str, str, bytes], ...]


def pack_bundles(round_: int, records: Sequence[tuple[str, str, bytes]], complete: bool) -> list[bytes]:
    """``records`` as as few bundles as fit the push limit (at least one, so an empty part still says
    ``complete``). A single record too big for a bundle raises ValueError (round records are at most 48 KiB)."""
    out: list[bytes] = []
    chunk: list[list[object]] = []
    for kind, signer, value in records:
        item = [kind, signer, bytes(value)]
        candidate = msgpack.packb({"round": round_, "complete": complete, "records": [*chunk, item]},
                                  use_bin_type=True)
        if len(candidate) > MAX_BUNDLE_BYTES or len(chunk) >= MAX_BUNDLE_RECORDS:
            if not chunk:
                raise ValueError(f"a {kind} record of {len(value)} bytes does not fit a bundle")
            out.append(msgpack.packb({"round": round_, "complete": complete, "records": chunk}, use_bin_type=True))
            chunk = []
        chunk.append(item)
    out.append(msgpack.packb({"round": round_, "complete": complete, "records": chunk}, use_bin_type=True))
    return out


def parse_bundle(data: object, round_: int) -> Bundle:
    """A bundle of round ``round_`` from untrusted bytes; raises ProtocolError for anything malformed."""
    body = unpack_msgpack(data, max_bytes=MAX_BUNDLE_BYTES, what="bundle", max_items=MAX_BUNDLE_RECORDS)
    if not isinstance(body, dict) or set(body) != {"round", "complete", "records"}:
        raise ProtocolError("a bundle is a map of round, complete and records")
    if body["round"] != round_ or isinstance(body["round"], bool) or not isinstance(body["complete"], bool):
        raise ProtocolError(f"a bundle of another round, or a malformed one (expected round {round_})")
    raw = body["records"]
    if not isinstance(raw, list):
        raise ProtocolError("a bundle's records must be a list")
    records = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 3 or item[0] not in BUNDLE_KINDS
                or not isinstance(item[1], str) or not _PEER.fullmatch(item[1]) or not isinstance(item[2], bytes)):
            raise ProtocolError("a bundle record must be [contrib|accepted, peer id, bytes]")
        records.append((item[0], item[1], item[2]))
    return Bundle(round_, body["complete"], tuple(records))
