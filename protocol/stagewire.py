"""Messages on a pipeline swarm's stage streams: one long-lived stream per pair of neighbours, many messages.

Each message is ``u32 header length | canonical msgpack header | u32 body length | body`` (big-endian lengths).
The header says what the message is (:data:`OPS`) and which micro-batch it belongs to; the body of a ``fwd`` or
``eval`` or ``guard`` is an activation frame (:mod:`hlbp.protocol.activations`) followed by the micro-batch's token
window (each row's first input id and its target ids, :func:`encode_tokens`), the body of a ``bwd`` is an
activation-gradient frame, and every other message has an empty body.

A ``guard`` is an ``eval`` at a round's candidate result: the driver sends the run's guard batch through its chain
while every stage holds the result of round ``round`` that it has computed but not yet committed, and the last
stage's answer (``gloss``) passes every stage on its way back, so each of them learns the whole model's loss at the
round's result before it commits (:mod:`hlbp.peer.swarm.guardslot`).

The header names the session (one driver's run of the swarm), the step (a counter that also advances over
abandoned steps), the micro-batch and its attempt, so a retried micro-batch never mixes with an older attempt.
A ``fwd`` carries the rest of its route (the peers of the later stages), so a stage knows where to send it on.

A step ends without a round trip of its own: the ``bwd`` that completes a stage's accumulation carries the squared
gradient norm of that stage and every later one (``sumsq``, marked complete by ``count``), so the driver knows the
whole norm when its own last backward is done, and its ``apply`` (the step's rate and clipping scale) goes down the
chain in front of the next step's first ``fwd``. Only a step whose norms did not come up complete (a micro-batch
re-run through another chain) asks for them with a ``finish`` down the chain, answered by a ``done`` back up.

Lengths are checked before anything is allocated: a header longer than :data:`MAX_HEADER` or a body longer than
the caller's limit (which comes from the receiver's own :class:`~hlbp.protocol.activations.ActivationSpec`) is
refused after reading 4 bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np
import torch

from hlbp.protocol.activations import HEADER, HEADER_SIZE
from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.fields import _bool, _float, _int, _str
from hlbp.protocol.untrusted import unpack_msgpack

OPS = ("fwd", "bwd", "eval", "loss", "finish", "done", "fail", "abort", "ping", "pong", "guard", "gloss", "apply",
       "share")
"""Message kinds. Downstream (towards the last stage): fwd, eval, guard, finish, apply, abort, ping. Upstream: bwd,
loss, gloss, done, fail, pong. Between peers of one stage that served the same step: share, apply."""
DOWNSTREAM = frozenset({"fwd", "eval", "guard", "finish", "apply", "abort", "ping"})
"""Ops a stage accepts from its upstream neighbour (the stream it was called on)."""
UPSTREAM = frozenset({"bwd", "loss", "gloss", "done", "fail", "pong"})
"""Ops a stage accepts from its downstream neighbour (the stream it dialled)."""
SIBLING = frozenset({"share", "apply"})
"""Ops a stage accepts from another peer of its own stage (a stream that peer opened)."""
MAX_HEADER = 4096
"""Largest header in bytes."""
MAX_ROUTE = 32
"""Most stages after the receiver that a route may name."""
MAX_MICROBATCHES = 4096
MAX_STAGE_PEERS = 8
"""Most peers that may serve one stage in one step."""
LINEAGE_BYTES = 32
SIG_BYTES = 64  # an Ed25519 signature
SIGNED_OPS = frozenset({"fwd", "bwd"})
"""Ops whose sender signs what it sends (:func:`frame_commitment`): the frames an audit recomputes."""
_COMMITMENT = b"hlbp-stage-frame-v1\x00"
LENGTH = struct.Struct(">I")
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58, as a libp2p peer id prints
_ID_DTYPES = {2: "<u2", 4: "<u4"}


class Reason(IntEnum):
    """What a ``pong`` or a ``fail`` says, as a code the receiver acts on (``reason`` is only text for the log).

    A header with a code outside this enum is refused with a :class:`ProtocolError`, like any other bad field."""

    NONE = 0
    ROUND = 1  # pong: the stage's round gate is closed (it is exchanging an outer round); its next step waits
    STREAM_CLOSED = 2  # fail: the stream to the named peer closed with micro-batches in flight
    UNREACHABLE = 3  # fail: the named peer could not be dialled
    INCOMPLETE = 4  # fail: a finish arrived before the step's micro-batches had all accumulated at the named peer
    ALREADY_APPLIED = 5  # fail: the named peer already applied this step; re-running it cannot help
    BAD_DONE = 6  # fail: the named peer sent a done that does not add up (rate, norm or scale); it was not applied
    BAD_FINISH = 7  # fail: the named peer sent a finish off the run's schedule (rate or clipping norm); not run
    NO_SHARE = 9  # fail: the named peer of the receiver's stage sent no gradient share within the trade's time
    BAD_SHARE = 10  # fail: the named peer of the receiver's stage sent a share that broke the rules (banned)
    UNSCORED = 8  # gloss: a stage of the chain holds no candidate of the guard's round (a round it passed or never
    # reached): the guard has no loss


@dataclass(frozen=True)
class StageMessage:
    """A decoded header; fields an op does not use keep their defaults."""

    op: str
    session: int = 0  # the driver's session id: a new one resets every stage's per-step state
    step: int = 0  # step counter of the session (abandoned steps advance it too)
    mb: int = 0  # micro-batch index within the step
    attempt: int = 0  # retry counter of this micro-batch
    route: tuple[str, ...] = ()  # fwd/eval/finish/apply: peers of the stages after the receiver, in order
    weight: float = 1.0  # fwd: the micro-batch's share of the step's tokens (its loss is scaled by it)
    loss: float = 0.0  # bwd/loss/gloss: the micro-batch's unscaled loss at the last stage
    # finish: squared gradient norm summed so far; done/apply: the total; bwd: the sum of the sender's and every
    # later stage's, complete when ``count`` is set
    sumsq: float = 0.0
    # fwd: micro-batches in the step; finish: micro-batches the step must have accumulated; bwd: the step's count
    # when the sender has accumulated all of them and ``sumsq`` covers it and every later stage (0: not yet)
    count: int = 0
    lr: float = 0.0  # finish/done/apply: learning rate of this optimizer step
    max_norm: float = 0.0  # finish/apply: gradient clipping threshold (0: none)
    scale: float = 1.0  # done/apply: factor every stage applies to its gradients before stepping (clipping)
    opt_step: int = 0  # finish/done/apply: index of the optimizer step
    peer: str = ""  # fail: the peer that failed
    reason: str = ""  # fail/abort: why, for the log
    code: Reason = Reason.NONE  # pong/fail/gloss: what happened, as a code the receiver acts on
    busy: tuple[float, ...] = field(default=())  # bwd/loss: seconds each stage computed for this micro-batch
    tokens: int = 0  # finish/done/apply: tokens of the step (what a stage's round contribution is weighted by)
    round_end: bool = False  # finish/done/apply: the swarm's last inner step of the round; stages contribute after
    # fwd/bwd: the outer round whose inner phase the step belongs to (the driver's count); guard/gloss: the round
    # whose candidate result the guard batch runs through
    round: int = 0
    inner: int = 0  # fwd/bwd: steps the swarm applied in that phase before this one (0: weights at the anchor)
    sig: bytes = b""  # fwd/bwd: the sender's Ed25519 signature over :func:`frame_commitment` of this hop
    # finish: the peers that served each stage of [receiver, *route] in the step beside the one the finish goes
    # through, ``per[i]`` of them for stage i, in order; share: every peer that served the sender's stage
    peers: tuple[str, ...] = ()
    per: tuple[int, ...] = ()
    lineage: bytes = b""  # share: the digest of the steps the sender's optimizer state has seen (peer.swarm.shares)


def _route(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("route", [])
    if not isinstance(value, list) or len(value) > MAX_ROUTE:
        raise ProtocolError(f"stage message route must be a list of at most {MAX_ROUTE} peer ids")
    return tuple(_str({"peer": p}, "peer", 128, pattern=_PEER) for p in value)


def _busy(body: dict[str, Any]) -> tuple[float, ...]:
    value = body.get("busy", [])
    if not isinstance(value, list) or len(value) > MAX_ROUTE + 1:
        raise ProtocolError(f"stage message busy must be a list of at most {MAX_ROUTE + 1} numbers")
    return tuple(_float({"s": s}, "s", 0.0, 1e6) for s in value)


def _peers(body: dict[str, Any]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    peers, per = body.get("peers", []), body.get("per", [])
    if not isinstance(peers, list) or not isinstance(per, list) or len(per) > MAX_ROUTE + 1 \
            or len(peers) > MAX_STAGE_PEERS * (MAX_ROUTE + 1):
        raise ProtocolError("stage message peers must be two short lists")
    counts = tuple(_int({"n": n}, "n", 0, MAX_STAGE_PEERS) for n in per)
    if per and sum(counts) != len(peers):
        raise ProtocolError(f"stage message names {len(peers)} peers, its counts add up to {sum(counts)}")
    return tuple(_str({"peer": p}, "peer", 128, pattern=_PEER) for p in peers), counts


def _lineage(body: dict[str, Any]) -> bytes:
    value = body.get("lineage", b"")
    if not isinstance(value, bytes) or len(value) not in (0, LINEAGE_BYTES):
        raise ProtocolError(f"stage message lineage must be {LINEAGE_BYTES} bytes")
    return value


def _reason(body: dict[str, Any]) -> Reason:
    value = _int(body, "code", 0, 255, 0)
    try:
        return Reason(value)
    except ValueError:
        raise ProtocolError(f"stage message has an unknown reason code {value}") from None


def _sig(body: dict[str, Any]) -> bytes:
    value = body.get("sig", b"")
    if not isinstance(value, bytes) or len(value) not in (0, SIG_BYTES):
        raise ProtocolError(f"stage message sig must be {SIG_BYTES} bytes")
    return value


def parse_header(obj: Any) -> StageMessage:
    """A :class:`StageMessage` from a decoded header map; any defect raises :class:`ProtocolError`."""
    if not isinstance(obj, dict):
        raise ProtocolError("stage message header must be a map")
    unknown = set(obj) - {f for f in StageMessage.__dataclass_fields__}
    if unknown:
        raise ProtocolError(f"stage message header has unknown fields {sorted(map(str, unknown))[:4]}")
    peers, per = _peers(obj)
    return StageMessage(
        op=_str(obj, "op", 8, choices=OPS),
        session=_int(obj, "session", 0, 2**63 - 1, 0),
        step=_int(obj, "step", 0, 2**40, 0),
        mb=_int(obj, "mb", 0, MAX_MICROBATCHES - 1, 0),
        attempt=_int(obj, "attempt", 0, 1 << 16, 0),
        route=_route(obj),
        weight=_float(obj, "weight", 0.0, 1.0, 1.0),
        loss=_float(obj, "loss", 0.0, 1e6, 0.0),
        sumsq=_float(obj, "sumsq", 0.0, 1e300, 0.0),
        count=_int(obj, "count", 0, MAX_MICROBATCHES, 0),
        lr=_float(obj, "lr", 0.0, 10.0, 0.0),
        max_norm=_float(obj, "max_norm", 0.0, 1e6, 0.0),
        scale=_float(obj, "scale", 0.0, 1.0, 1.0),
        opt_step=_int(obj, "opt_step", 0, 2**40, 0),
        peer=_str(obj, "peer", 128, "", pattern=re.compile(r"|" + _PEER.pattern)),
        reason=_str(obj, "reason", 200, ""),
        code=_reason(obj),
        busy=_busy(obj),
        tokens=_int(obj, "tokens", 0, 1 << 40, 0),
        round_end=_bool(obj, "round_end", False),
        round=_int(obj, "round", 0, 2**40, 0),
        inner=_int(obj, "inner", 0, 1 << 20, 0),
        sig=_sig(obj),
        peers=peers,
        per=per,
        lineage=_lineage(obj),
    )


def header_map(msg: StageMessage) -> dict[str, Any]:
    """The header map of ``msg``: only the fields that differ from their defaults travel."""
    out: dict[str, Any] = {"op": msg.op}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        default = f.default if f.default is not dataclasses.MISSING else ()
        if f.name != "op" and value != default:
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Reason):
                value = int(value)  # a plain msgpack integer on the wire
            out[f.name] = value
    return out


def encode_message(msg: StageMessage, body: bytes = b"") -> bytes:
    """The bytes of one message; raises ValueError for a header the receiver would refuse."""
    parse_header(header_map(msg))  # the sender fails first, with the same checks
    head = msgpack.packb(header_map(msg), use_bin_type=True)
    if len(head) > MAX_HEADER:
        raise ValueError(f"stage message header of {len(head)} bytes exceeds {MAX_HEADER}")
    return b"".join((LENGTH.pack(len(head)), head, LENGTH.pack(len(body)), body))


def frame_commitment(msg: StageMessage, body: bytes) -> bytes:
    """The bytes a stage peer signs for one ``fwd`` or ``bwd`` hop: which micro-batch of which step and round it
    belongs to, the fields that change what the receiver computes (the loss weight; the loss it reports), and the
    SHA-256 of the body. The route and the busy times are left out: each hop changes them, and they change no
    number of the step. A signature over this binds its sender to the frame for good: an auditor holding the frame
    and the signature needs nothing else to show what that peer sent."""
    fields = [msg.op, msg.session, msg.step, msg.mb, msg.attempt, msg.round, msg.inner, msg.weight, msg.loss,
              hashlib.sha256(body).digest()]
    return _COMMITMENT + msgpack.packb(fields, use_bin_type=True)


def header_length(data: bytes) -> int:
    """Header length from the first 4 bytes, checked against :data:`MAX_HEADER` before anything is read."""
    (n,) = LENGTH.unpack(data)
    if n > MAX_HEADER:
        raise ProtocolError(f"stage message header of {n} bytes exceeds the limit of {MAX_HEADER}")
    return n


def decode_header(data: bytes) -> StageMessage:
    """An untrusted header's bytes (canonical msgpack) as a checked :class:`StageMessage`."""
    return parse_header(unpack_msgpack(data, max_bytes=MAX_HEADER, what="stage message header", max_depth=2))


def body_length(data: bytes, msg: StageMessage, max_body: int, max_share: int = 0) -> int:
    """Body length from its 4 bytes: at most ``max_body`` for ops that carry a frame, ``max_share`` for a gradient
    share (:mod:`hlbp.protocol.gradshare`), 0 for the others."""
    (n,) = LENGTH.unpack(data)
    limit = max_body if msg.op in ("fwd", "eval", "guard", "bwd") else max_share if msg.op == "share" else 0
    if n > limit:
        raise ProtocolError(f"a {msg.op} message with a body of {n} bytes (the limit here is {limit})")
    return n


def decode_message(data: bytes, max_body: int, max_share: int = 0) -> tuple[StageMessage, bytes]:
    """A whole message held in memory (tests and fuzzing use this; streams read the same pieces in order)."""
    if len(data) < 8:
        raise ProtocolError(f"stage message of {len(data)} bytes is shorter than its two length fields")
    n = header_length(data[:4])
    if len(data) < 8 + n:
        raise ProtocolError("stage message ends inside its header")
    msg = decode_header(data[4:4 + n])
    size = body_length(data[4 + n:8 + n], msg, max_body, max_share)
    if len(data) != 8 + n + size:
        raise ProtocolError(f"stage message has {len(data) - 8 - n} body bytes, its length field says {size}")
    return msg, data[8 + n:]


# --- the token window after a frame ---------------------------------------------------------------------------


def _id_size(vocab_size: int) -> int:
    return 2 if vocab_size <= 1 << 16 else 4


def encode_tokens(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> bytes:
    """A micro-batch's token window [batch, seq + 1] after its frame: each row's first input id, then its targets
    (the inputs shifted by one), as little-endian u16 (vocabularies up to 65,536) or u32. The last stage needs the
    targets; the first input ids let an auditor recompute stage 0 from what it signed, whatever the codec carries
    (the inputs are the window without its last column)."""
    window = torch.cat([inputs.detach()[:, :1].to("cpu", torch.int64), targets.detach().to("cpu", torch.int64)], 1)
    return window.numpy().astype(_ID_DTYPES[_id_size(vocab_size)]).tobytes()


def tokens_size(batch: int, seq: int, vocab_size: int) -> int:
    """Bytes of the token window of a ``batch`` x ``seq`` micro-batch."""
    return batch * (seq + 1) * _id_size(vocab_size)


def decode_tokens(data: bytes, shape: tuple[int, int], vocab_size: int) -> torch.Tensor:
    """Untrusted token window [batch, seq + 1] of a micro-batch of ``shape`` (:func:`encode_tokens`): its targets
    are ``[:, 1:]``, its inputs ``[:, :-1]``. A wrong length or an id outside the vocabulary raise."""
    size = _id_size(vocab_size)
    expected = tokens_size(shape[0], shape[1], vocab_size)
    if len(data) != expected:
        raise ProtocolError(f"token window of {len(data)} bytes for a {shape[0]} x {shape[1]} micro-batch "
                            f"(expected {expected})")
    ids = np.frombuffer(data, dtype=_ID_DTYPES[size]).astype(np.int64)
    if ids.size and int(ids.max()) >= vocab_size:
        raise ProtocolError(f"token id {int(ids.max())} is outside the vocabulary of {vocab_size}")
    return torch.from_numpy(ids).view(shape[0], shape[1] + 1)


def decode_targets(data: bytes, shape: tuple[int, int], vocab_size: int) -> torch.Tensor:
    """The targets [batch, seq] of an untrusted token window (:func:`decode_tokens`)."""
    return decode_tokens(data, shape, vocab_size)[:, 1:]


def split_body(body: bytes, vocab_size: int) -> tuple[bytes, bytes]:
    """(activation frame, token window) of a fwd/eval body; the frame's own header sizes the window, which
    :func:`decode_tokens` then checks against the decoded frame's shape."""
    if len(body) < HEADER_SIZE:
        raise ProtocolError(f"a forward body of {len(body)} bytes cannot hold an activation frame")
    batch, seq = HEADER.unpack_from(body)[6:8]
    size = tokens_size(batch, seq, vocab_size)
    if batch < 1 or seq < 1 or size > len(body) - HEADER_SIZE:
        raise ProtocolError(f"a forward body of {len(body)} bytes cannot hold a {batch} x {seq} frame and its tokens")
    return body[:-size], body[-size:]
