"""Audits by recomputation: is what a stage peer sent its stage's output for what it received?

Right after a round is applied, every holder of a shard has the same weights (the checksummed anchor), and a full
replica holds every stage's. So the frames a stage peer exchanged in the first step of a phase are checkable
exactly by anyone holding the anchor. Those of later steps are not: the stage's weights have moved by a few inner
steps, which early in a run changes what it computes as much as a lie would (:class:`Tolerance`).

The evidence of one micro-batch attempt at stage s (every frame signed by its sender, :mod:`hlbp.peer.swarm.
transcript`):

- ``x``: the ``fwd`` the audited peer received (its input, signed by its upstream neighbour; none on stage 0,
  whose input is token ids);
- ``y``: the ``fwd`` it sent (its output, held by its downstream neighbour; none on the last stage);
- ``g_out``: the ``bwd`` it received (the gradient of its output; none on the last stage, which computes the loss);
- ``g_in``: the ``bwd`` it sent (the gradient of its input; none on stage 0).

:func:`audit` recomputes the stage at the anchor on ``x`` (and ``g_out``), passes the results through the run's
codec as the peer would have, and compares with ``y`` (and ``g_in``): the relative L2 distance, cosine and norm
ratio of the decoded tensors, judged at the phase's first step only (:class:`Tolerance`). It is a pure
function of its arguments (torch on this process's device), so the same evidence gives every auditor the same
finding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.model.decoder import Stage
from hlbp.peer.train.trainer import autocast
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import StageMessage, decode_targets, split_body

Frame = tuple[StageMessage, bytes]


class Finding(Enum):
    """What an audit of one micro-batch attempt found."""

    CLEAN = "clean"  # what it sent is its stage's output for what it received, within the tolerance
    UNJUDGED = "unjudged"  # a step after the phase's first: compared and reported, not judged (Tolerance)
    STALE = "stale"  # near its stage's output at the anchor but not it: computed on other weights (a peer that had
    # not loaded the round's result when it served the step); its work is not the round's, but no lie is shown
    FORWARD = "forward"  # the activations it sent are not its stage's output for its input
    BACKWARD = "backward"  # the input gradient it sent is not its stage's for the output gradient it received
    LABELS = "labels"  # it relabelled a micro-batch (round, inner step, loss weight) between receiving and sending
    BAD_FRAME = "bad frame"  # a frame it signed does not decode
    INCONCLUSIVE = "inconclusive"  # the evidence does not allow a check (a frame missing, or one it did not sign)

    @property
    def guilty(self) -> bool:
        """Whether the finding convicts the audited peer (its own signed frames show it)."""
        return self in (Finding.FORWARD, Finding.BACKWARD, Finding.LABELS, Finding.BAD_FRAME)


@dataclass(frozen=True)
class Tolerance:
    """What an honest stage peer's frame may show against a recomputation at the anchor.

    Only the phase's first step (``inner`` 0) is judged: the peer's weights are then the anchor, so its frame must
    equal the recomputation up to float reduction order, codec rounding and a GPU's bf16 autocast, a relative error
    of at most ``exact``. After k inner steps its weights have moved, early in a run by far more than one would guess:
    measured on honest peers of a subspace-B run in its first rounds, stage 0's output grew 8-15x in norm over 5-7
    AdamW steps and the last stage's input gradient shrank 4x (cosine with the anchor's down to 0.14), which is what
    a liar's scale, flip or noise looks like. So later steps are compared and reported, never judged
    (docs/security.md, "Pipeline swarms: commitments and audits")."""

    exact: float = 0.02
    stale_cosine: float = 0.5
    stale_ratio: float = 3.0

    def passes(self, c: Comparison, inner: int) -> bool | None:
        """Whether a frame of inner step ``inner`` that compares as ``c`` is honest; None: not judged (a later
        step)."""
        return c.error <= self.exact if inner == 0 else None

    def stale(self, c: Comparison) -> bool:
        """Whether a frame of the first step that is not exact is still near the recomputation: cosine at least
        ``stale_cosine`` and norm within ``stale_ratio``. Honest peers that served a step with the previous
        round's weights (a standby switched into the chain before it loaded the round's result) showed cosine
        0.95-0.995 and ratio 0.99-1.19; a lie of scale 10, a flip or noise shows ratio 10, cosine -1 or about 0.
        Such work is refused like a lie's, but its sender is not banned."""
        return c.cosine >= self.stale_cosine and 1 / self.stale_ratio <= c.ratio <= self.stale_ratio


@dataclass(frozen=True)
class Evidence:
    """The frames of one micro-batch attempt at one stage (see the module docstring); None where not held."""

    x: Frame | None
    y: Frame | None
    g_out: Frame | None
    g_in: Frame | None


@dataclass(frozen=True)
class AuditResult:
    finding: Finding
    inner: int = 0  # inner steps the phase had applied before this micro-batch's step
    forward: Comparison | None = None  # the output it sent against the recomputed one
    backward: Comparison | None = None  # the input gradient it sent against the recomputed one
    detail: str = ""


@dataclass(frozen=True)
class Comparison:
    """How a frame a peer sent compares with the recomputed one: the relative L2 distance, the cosine and the
    ratio of norms (sent over recomputed), each in float64 and per micro-batch."""

    error: float
    cosine: float
    ratio: float


def compare(sent: torch.Tensor, mine: torch.Tensor) -> Comparison:
    """:class:`Comparison` of two tensors (a frame of zeros against a zero recomputation is no error)."""
    a, b = sent.double().flatten(), mine.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    diff = float((a - b).norm())
    error = diff / nb if nb > 0 else (0.0 if diff == 0 else float("inf"))
    cosine = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    ratio = na / nb if nb > 0 else (1.0 if na == 0 else float("inf"))
    return Comparison(error, cosine, ratio)


def _labels(msg: StageMessage) -> tuple[int, int, int, int, int, int, float]:
    return msg.session, msg.step, msg.mb, msg.attempt, msg.round, msg.inner, msg.weight


def audit(stage: Stage, codec: ActivationCodec, vocab_size: int, evidence: Evidence,
          tolerance: Tolerance = Tolerance(), params: Mapping[str, torch.Tensor] | None = None) -> AuditResult:
    """Recompute ``stage`` at the anchor on the evidence and judge what the peer sent. The anchor is ``params``
    (name -> tensor, run through ``stage`` by ``torch.func.functional_call``, so ``stage`` may be a skeleton
    holding no parameter memory, :func:`hlbp.peer.train.trainer.skeleton`), or else ``stage``'s own weights."""
    first, last = stage.is_first, stage.is_last
    e = evidence
    need_fwd = e.x is not None or first  # the input: a received frame, or token ids carried by the output
    if not need_fwd or (e.y is None and not last) or (last and (e.x is None or e.g_in is None)):
        return AuditResult(Finding.INCONCLUSIVE, detail="the frames to recompute from are not all held")
    src = e.x if e.x is not None else e.y
    assert src is not None
    inner = src[0].inner
    expect = _labels(src[0])
    relabelled = e.x is not None and ((e.y is not None and _labels(e.y[0]) != expect)
                                      or (e.g_in is not None and _labels(e.g_in[0])[:6] != expect[:6]))
    if relabelled:
        return AuditResult(Finding.LABELS, inner, detail="its frames carry other labels than its input")
    device = next(iter(params.values())).device if params else next(stage.parameters()).device

    own = None if params is None else {n: params[n].to(device) for n, _ in stage.named_parameters()}

    def run(x: torch.Tensor) -> torch.Tensor:
        return stage(x) if own is None else torch.func.functional_call(stage, own, (x,))

    try:
        inp, token_ids, targets = _input(stage, codec, vocab_size, e)
    except ProtocolError as exc:
        return AuditResult(Finding.INCONCLUSIVE, inner, detail=f"its input does not decode: {exc}")
    stage.train(True)
    leaf = None if first else inp.to(device).detach().requires_grad_(True)
    with torch.enable_grad(), autocast(device):
        out = run(inp.to(device) if first else leaf)
        if last:
            assert e.x is not None and targets is not None
            out = stage.loss(out, targets.to(device)) * e.x[0].weight
    try:
        fwd = None if last else _forward_error(codec, vocab_size, out.detach(), token_ids, e.y)
        bwd = None
        if not first:
            assert leaf is not None
            grad_out = None if last else _received_grad(codec, e.g_out, out.shape)
            if last or grad_out is not None:
                (g,) = torch.autograd.grad(out, leaf, None if last else grad_out.to(device, out.dtype))
                bwd = _backward_error(codec, g.detach(), e.g_in)
    except _Unsigned as exc:
        return AuditResult(Finding.BAD_FRAME, inner, detail=str(exc))
    if inner > 0:
        return AuditResult(Finding.UNJUDGED, inner, fwd, bwd)
    off = [(c, f) for c, f in ((fwd, Finding.FORWARD), (bwd, Finding.BACKWARD))
           if c is not None and not tolerance.passes(c, inner)]
    if not off:
        return AuditResult(Finding.CLEAN, inner, fwd, bwd)
    far = [f for c, f in off if not tolerance.stale(c)]
    return AuditResult(far[0] if far else Finding.STALE, inner, fwd, bwd)


class _Unsigned(Exception):
    """A frame the audited peer signed does not decode: that alone convicts it."""


def _input(stage: Stage, codec: ActivationCodec, vocab_size: int,
           e: Evidence) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(the stage's input, the token ids that travel with it, the targets on the last stage) from the evidence."""
    if stage.is_first:
        assert e.y is not None
        frame, _ = split_body(e.y[1], vocab_size)
        received = codec.decode_forward(frame)
        if received.token_ids is None:
            raise ProtocolError("this codec carries no token ids: stage 0's input is not in its output frame")
        return received.token_ids, received.token_ids, None
    assert e.x is not None
    frame, targets_bytes = split_body(e.x[1], vocab_size)
    received = codec.decode_forward(frame)
    shape = (received.tensor.shape[0], received.tensor.shape[1])
    targets = decode_targets(targets_bytes, shape, vocab_size) if stage.is_last else None
    return received.tensor, received.token_ids, targets


def _forward_error(codec: ActivationCodec, vocab_size: int, out: torch.Tensor, token_ids: torch.Tensor | None,
                   y: Frame | None) -> Comparison:
    assert y is not None
    try:
        frame, _ = split_body(y[1], vocab_size)
        sent = codec.decode_forward(frame).tensor
    except ProtocolError as exc:
        raise _Unsigned(f"the output frame it signed does not decode: {exc}") from exc
    ids = token_ids if token_ids is not None else torch.zeros(out.shape[:2], dtype=torch.long)
    mine = codec.decode_forward(codec.encode_forward(out.float().cpu(), ids.cpu())).tensor
    if sent.shape != mine.shape:
        raise _Unsigned(f"its output frame has shape {tuple(sent.shape)}, its stage gives {tuple(mine.shape)}")
    return compare(sent, mine)


def _received_grad(codec: ActivationCodec, g_out: Frame | None, shape: torch.Size) -> torch.Tensor | None:
    """The output gradient the peer received (signed by its downstream neighbour), or None when not held or not
    decodable (the neighbour's fault, not the peer's: the backward check is then skipped)."""
    if g_out is None:
        return None
    try:
        return codec.decode_backward(g_out[1], (shape[0], shape[1])).tensor
    except ProtocolError:
        return None


def _backward_error(codec: ActivationCodec, g: torch.Tensor, g_in: Frame | None) -> Comparison | None:
    if g_in is None:
        return None
    try:
        sent = codec.decode_backward(g_in[1], (g.shape[0], g.shape[1])).tensor
    except ProtocolError as exc:
        raise _Unsigned(f"the gradient frame it signed does not decode: {exc}") from exc
    mine = codec.decode_backward(codec.encode_backward(g.float().cpu())).tensor
    return compare(sent, mine)

