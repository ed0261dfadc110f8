"""Commitments on a swarm's streams: every ``fwd`` and ``bwd`` hop is signed by its sender, checked by its receiver
and kept, so that what a stage peer sent can be shown to an auditor later and never denied.

A stage peer that lies (scaled, sign-flipped or made-up activations or gradients) sends its lie signed. Its
neighbours keep the signed frames they received (:class:`Transcript`, bounded by bytes, oldest first out); the peer
itself keeps the frames it computed from. An auditor that fetches the input a peer received (signed by its upstream
neighbour) and the output it sent (signed by itself, held by its downstream neighbour) can recompute the stage and
knows the peer cannot answer differently from what it really sent (:mod:`hlbp.peer.swarm.audit`). Audits look at
frames after the fact, so a peer cannot tell, when it computes, which micro-batches will be checked.

:class:`Notary` is what the stage server and the driver hold: it seals outgoing frames with the peer's identity,
and checks and keeps incoming ones. Serving the transcript on the data plane is :meth:`Transcript.serve`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from hlbp.peer.swarm.screen import FrameScreen
from hlbp.protocol.identity import Identity, verify_signature
from hlbp.protocol.stagewire import SIGNED_OPS, StageMessage, encode_message, frame_commitment
from hlbp.protocol.transcript import (
    FRAME_PREFIX,
    INDEX_PREFIX,
    FrameKey,
    IndexEntry,
    encode_index,
    encode_kept,
)

DEFAULT_MAX_BYTES = 256 << 20  # what a peer keeps for audits: a few rounds of compressed frames
MAX_WITHDRAWN = 256  # rounds whose withdrawal a peer remembers (the newest; audits look at the last round or two)


class Transcript:
    """Signed frames this peer received, by key, with the outer round each belongs to; at most ``max_bytes`` of
    messages, the oldest dropped first. Thread-safe: the links' loop keeps, the transport's workers read."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        # key -> (round, inner, message, the count of frames kept before it)
        self._frames: OrderedDict[FrameKey, tuple[int, int, bytes, int]] = OrderedDict()
        self._flagged: set[FrameKey] = set()  # kept frames the screen found outlying
        self._bytes = 0
        self._kept = 0  # frames kept so far
        self._phase: tuple[int, int] | None = None  # (round, frames kept before it) of this peer's phase under way
        self._withdrawing = False  # every frame kept now has its round withdrawn (until the next phase starts)
        self._withdrawn: set[int] = set()  # rounds whose work this peer takes back (:meth:`withdraw_phase`)
        self.dropped = 0
        self._lock = threading.Lock()

    def keep(self, sender: str, msg: StageMessage, body: bytes) -> None:
        """Keep a received, already checked frame (its whole message, signature included)."""
        key = FrameKey(sender, msg.op, msg.session, msg.step, msg.mb, msg.attempt)
        message = encode_message(replace(msg, route=(), busy=()), body)
        with self._lock:
            old = self._frames.pop(key, None)
            if old is not None:
                self._bytes -= len(old[2])
                self._flagged.discard(key)
            self._frames[key] = (msg.round, msg.inner, message, self._kept)
            self._kept += 1
            if self._withdrawing:
                self._withdraw({msg.round})
            self._bytes += len(message)
            while self._bytes > self.max_bytes and self._frames:
                gone_key, (_, _, gone, _) = self._frames.popitem(last=False)
                self._bytes -= len(gone)
                self._flagged.discard(gone_key)
                self.dropped += 1

    def flag(self, key: FrameKey) -> None:
        """Mark a kept frame as one the screen found outlying (listed so in the index; a frame not kept is not
        marked)."""
        with self._lock:
            if key in self._frames:
                self._flagged.add(key)

    def phase_started(self, r: int) -> None:
        """This peer's inner phase of round ``r`` starts: the frames kept from now on are what it computed from."""
        with self._lock:
            self._phase = (r, self._kept)
            self._withdrawing = False

    def withdraw_phase(self, r: int) -> bool:
        """Take back this peer's work of the phase of round ``r`` if it is the phase under way (a resync replaced
        the state it trained from, so nothing it computed there is at the round's anchor): the round of every
        frame kept since the phase started, and of every frame kept until the next phase starts, is listed as
        withdrawn in its index. Returns whether it was the phase under way."""
        with self._lock:
            if self._phase is None or self._phase[0] != r:
                return False
            start = self._phase[1]
            self._withdraw({rr for rr, _, _, seq in self._frames.values() if seq >= start} | {r})
            self._withdrawing = True
            return True

    def _withdraw(self, rounds: set[int]) -> None:
        self._withdrawn |= rounds
        while len(self._withdrawn) > MAX_WITHDRAWN:
            self._withdrawn.discard(min(self._withdrawn))

    def withdrawn(self, r: int) -> bool:
        """Whether this peer took back its work of round ``r``."""
        with self._lock:
            return r in self._withdrawn

    def frame(self, key: FrameKey) -> bytes | None:
        """The kept frame ``key`` as served (:func:`~hlbp.protocol.transcript.encode_kept`), or None."""
        with self._lock:
            kept = self._frames.get(key)
        return None if kept is None else encode_kept(key.sender, kept[2])

    def index(self, r: int) -> list[IndexEntry]:
        """The kept frames of round ``r``."""
        with self._lock:
            return [IndexEntry(k, inner, k in self._flagged)
                    for k, (rr, inner, _, _) in self._frames.items() if rr == r]

    def resolve(self, name: str) -> bytes | None:
        """The bytes served under blob name ``name`` (an index or a frame), or None: the data plane's answer to an
        auditor (``transport.put_lazy_prefix``). Names are untrusted: anything unparsable is "not here"."""
        if name.startswith(INDEX_PREFIX):
            tail = name[len(INDEX_PREFIX):]
            if not (tail.isdigit() and len(tail) < 16):
                return None
            return encode_index(self.index(int(tail)), self.withdrawn(int(tail)))
        parts = name[len(FRAME_PREFIX):].split("/") if name.startswith(FRAME_PREFIX) else []
        if len(parts) != 6 or parts[1] not in SIGNED_OPS or not all(p.isdigit() and len(p) < 20 for p in parts[2:]):
            return None
        session, step, mb, attempt = (int(p) for p in parts[2:])
        return self.frame(FrameKey(parts[0], parts[1], session, step, mb, attempt))

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)


class Notary:
    """Seals what this peer sends on its stage streams, checks and keeps what it receives, and screens what it
    decoded of it (:meth:`observe`)."""

    def __init__(self, identity: Identity, transcript: Transcript | None = None, screen: FrameScreen | None = None) -> None:
        self.identity = identity
        self.transcript = transcript if transcript is not None else Transcript()
        self.screen = screen if screen is not None else FrameScreen()

    def seal(self, msg: StageMessage, body: bytes) -> StageMessage:
        """``msg`` signed by this peer for ``body`` (ops that are not signed pass unchanged)."""
        if msg.op not in SIGNED_OPS:
            return msg
        return replace(msg, sig=self.identity.sign(frame_commitment(msg, body)))

    def receive(self, sender: str, msg: StageMessage, body: bytes) -> str | None:
        """Why a frame from ``sender`` is refused (no signature, or one that does not verify), or None: then it is
        kept for audits. Ops that are not signed pass."""
        if msg.op not in SIGNED_OPS:
            return None
        if not msg.sig:
            return f"an unsigned {msg.op}"
        if not verify_signature(sender, frame_commitment(msg, body), msg.sig):
            return f"a {msg.op} whose signature does not verify"
        self.transcript.keep(sender, msg, body)
        return None


    def observe(self, sender: str, msg: StageMessage, tensor: torch.Tensor) -> set[FrameKey]:
        """Screen the decoded tensor of a frame received and kept from ``sender``; the outliers found (this frame,
        or at a boundary's warm-up end any of its first frames) are marked in the transcript, so auditors draw them
        first. Returns the frames marked."""
        if msg.op not in SIGNED_OPS:
            return set()
        key = FrameKey(sender, msg.op, msg.session, msg.step, msg.mb, msg.attempt)
        found = self.screen.observe(sender, msg.op, tensor, key)
        marked = {k for k in found if isinstance(k, FrameKey)}
        for k in marked:
            self.transcript.flag(k)
        return marked


def sealed(notary: Notary | None, msg: StageMessage, body: bytes = b"") -> bytes:
    """The bytes of ``msg`` with ``body``, signed by ``notary`` when there is one (a swarm without commitments is
    one built by a test of another part)."""
    return encode_message(msg if notary is None else notary.seal(msg, body), body)
