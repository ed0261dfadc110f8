"""What a stage peer serves to auditors: the signed frames it received, and an index of them per outer round.

Every ``fwd`` and ``bwd`` hop of a pipeline swarm is signed by its sender (:func:`~hlbp.protocol.stagewire.
frame_commitment`), and its receiver keeps the whole message for a while. An auditor fetches, by name from the
peer's blob transport:

- ``audit/i/<round>``: the index of round ``round``, a canonical msgpack ``[withdrawn, entries]``: ``entries`` a list
  of ``[sender, op, session, step, mb, attempt, inner, flagged]``, one per kept frame (``flagged``: 1 when the
  holder's screen found the frame an outlier, :mod:`hlbp.peer.swarm.screen`; else 0), and ``withdrawn`` 1 when the
  holder takes its own work of the round back (it trained that phase from a state a resync then replaced, so its
  frames are not the round's anchor's; the auditor then leaves its work and its chain's out, banning nobody)
  (:func:`decode_index`);
- ``audit/f/<sender>/<op>/<session>/<step>/<mb>/<attempt>``: one kept frame, ``[sender, message bytes]``
  (:func:`decode_kept`), whose signature the auditor checks against ``sender`` before it believes a byte.

The index only says where to look; what counts is a frame whose sender's signature verifies, which its holder can
neither forge nor alter. Everything here is untrusted input and raises :class:`ProtocolError` on any defect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.identity import verify_signature
from hlbp.protocol.stagewire import SIGNED_OPS, StageMessage, decode_message, frame_commitment
from hlbp.protocol.untrusted import unpack_msgpack

AUDIT_PREFIX = "audit/"  # every name an auditor fetches from a stage peer
INDEX_PREFIX = "audit/i/"
FRAME_PREFIX = "audit/f/"
MAX_INDEX_ENTRIES = 1 << 16
_ENTRY_BYTES = 200  # a bound on one encoded entry (a 52-character peer id, an op and six integers)
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")


@dataclass(frozen=True)
class FrameKey:
    """Which frame: its sender, its op and the micro-batch attempt it carried."""

    sender: str
    op: str
    session: int
    step: int
    mb: int
    attempt: int

    @property
    def name(self) -> str:
        """The blob name the frame's holder serves it under."""
        return f"{FRAME_PREFIX}{self.sender}/{self.op}/{self.session}/{self.step}/{self.mb}/{self.attempt}"

    def micro_batch(self) -> tuple[int, int, int, int]:
        """(session, step, mb, attempt): the micro-batch attempt, whoever sent the frame."""
        return self.session, self.step, self.mb, self.attempt


@dataclass(frozen=True)
class IndexEntry:
    """One kept frame of a round, as its holder lists it: the key, the step's place in the round's phase, and whether
    the holder's screen found it an outlier (a hint of where to look, never evidence)."""

    key: FrameKey
    inner: int
    flagged: bool = False


def index_name(r: int) -> str:
    return f"{INDEX_PREFIX}{r}"


@dataclass(frozen=True)
class RoundIndex:
    """A holder's index of one round: the frames it kept, and whether it withdrew its own work of the round."""

    entries: list[IndexEntry]
    withdrawn: bool = False


def encode_index(entries: list[IndexEntry], withdrawn: bool = False) -> bytes:
    rows = [[e.key.sender, e.key.op, e.key.session, e.key.step, e.key.mb, e.key.attempt, e.inner, int(e.flagged)]
            for e in entries[:MAX_INDEX_ENTRIES]]
    return msgpack.packb([int(withdrawn), rows], use_bin_type=True)


def _nat(value: object, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise ProtocolError("an audit index entry holds a number out of range")
    return value


def decode_index(data: bytes, max_entries: int = MAX_INDEX_ENTRIES) -> RoundIndex:
    """An untrusted index; any defect raises :class:`ProtocolError`."""
    obj = unpack_msgpack(data, max_bytes=16 + max_entries * _ENTRY_BYTES, what="audit index", max_depth=3)
    if not isinstance(obj, list) or len(obj) != 2:
        raise ProtocolError("an audit index must be [withdrawn, entries]")
    withdrawn, rows = obj
    if not isinstance(rows, list) or len(rows) > max_entries:
        raise ProtocolError(f"an audit index must list at most {max_entries} entries")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 8:
            raise ProtocolError("an audit index entry must be a list of 8 fields")
        sender, op = row[0], row[1]
        if not isinstance(sender, str) or not _PEER.fullmatch(sender):
            raise ProtocolError("an audit index entry names no peer")
        if op not in SIGNED_OPS:
            raise ProtocolError("an audit index entry names an op that is not kept")
        key = FrameKey(sender, op, _nat(row[2], 2**63 - 1), _nat(row[3], 2**40), _nat(row[4], 1 << 16),
                       _nat(row[5], 1 << 16))
        out.append(IndexEntry(key, _nat(row[6], 1 << 20), bool(_nat(row[7], 1))))
    return RoundIndex(out, bool(_nat(withdrawn, 1)))


def encode_kept(sender: str, message: bytes) -> bytes:
    return msgpack.packb([sender, message], use_bin_type=True)


def decode_kept(data: bytes, key: FrameKey, max_body: int) -> tuple[StageMessage, bytes]:
    """A kept frame fetched for ``key``: its message and body, once its sender's signature over the message has
    been checked and the message is the one ``key`` names. Raises :class:`ProtocolError` otherwise (a holder that
    answers with another frame, or a frame nobody signed, proves nothing)."""
    obj = unpack_msgpack(data, max_bytes=max_body + 4096 + 256, what="kept frame", max_depth=1)
    if not isinstance(obj, list) or len(obj) != 2 or not isinstance(obj[0], str) or not isinstance(obj[1], bytes):
        raise ProtocolError("a kept frame must be [sender, message bytes]")
    sender, message = obj
    if sender != key.sender:
        raise ProtocolError("a kept frame from another sender than the one asked for")
    msg, body = decode_message(message, max_body)
    if (msg.op, msg.session, msg.step, msg.mb, msg.attempt) != (key.op, key.session, key.step, key.mb, key.attempt):
        raise ProtocolError("a kept frame of another micro-batch than the one asked for")
    if not verify_signature(sender, frame_commitment(msg, body), msg.sig):
        raise ProtocolError("a kept frame whose signature does not verify")
    return msg, body
