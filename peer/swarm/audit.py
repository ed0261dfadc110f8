"""Audits by recomputation: is what a stage peer sent its stage's output for what it received?

Right after a round is applied, every holder of a shard has the same weights (the checksummed anchor), and a full
replica holds every stage's. So the frames a stage peer exchanged in the first step of a phase are checkable
exactly by anyone holding the anchor. Those of later steps are not: the stage's weights have moved by a few inner
steps, which early in a run changes what it computes as much as a lie would. But every micro-batch of one step went
through the same weights, so at the anchor they all drift alike: a later step's frame is judged against the frames
of its own step, its siblings (:func:`judge_step`, :class:`Tolerance`).

The evidence of one micro-batch attempt at stage s (every frame signed by its sender, :mod:`hlbp.peer.swarm.
transcript`):

- ``x``: the ``fwd`` the audited peer received (its input, signed by its upstream neighbour; none on stage 0,
  whose input is token ids: carried by its output frame, or by the token window it signed with that frame);
- ``y``: the ``fwd`` it sent (its output, held by its downstream neighbour; none on the last stage);
- ``g_out``: the ``bwd`` it received (the gradient of its output; none on the last stage, which computes the loss);
- ``g_in``: the ``bwd`` it sent (the gradient of its input; none on stage 0).

:func:`audit` recomputes the stage at the anchor on ``x`` (and ``g_out``), passes the results through the run's
codec as the peer would have, and compares with ``y`` (and ``g_in``): the relative L2 distance, cosine and norm
ratio of the decoded tensors, judged exactly at the phase's first step; a later step's finding is
:attr:`Finding.UNJUDGED` until :func:`judge_step` weighs it against its siblings. Both are pure functions of their
arguments (torch on this process's device), so the same evidence gives every auditor the same
finding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

import torch

from hlbp.peer.model.codec import ActivationCodec
from hlbp.peer.model.decoder import Stage
from hlbp.peer.train.trainer import autocast
from hlbp.protocol import ProtocolError
from hlbp.protocol.stagewire import StageMessage, decode_targets, decode_tokens, split_body

Frame = tuple[StageMessage, bytes]


class Finding(Enum):
    """What an audit of one micro-batch attempt found."""

    CLEAN = "clean"  # what it sent is its stage's output for what it received, within the tolerance
    UNJUDGED = "unjudged"  # a step after the phase's first that its siblings cannot judge (Tolerance.later)
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

    The phase's first step (``inner`` 0): the peer's weights are the anchor, so its frame must equal the
    recomputation up to float reduction order and codec rounding, a relative error of at most ``exact``, or up to
    the precision the two sides computed in: a peer on a GPU computes under bf16 autocast, and its auditor may run
    in float32 on a CPU (or the other way round). That error grows with the stage's depth and width: measured
    between an H200's bf16 and a CPU's float32 at the initial weights, 2.6e-3 (tiny) to 8.3e-3 (125m, 3 stages) and
    1.7e-2 (1b, 2 stages), near ``exact``. So a frame above ``exact`` is recomputed once more at the auditor's other
    precision (float32 where it ran bf16, bf16 where it ran float32), and passes when its error is at most
    ``precision`` times the distance between the auditor's own two results (its ``noise``). After k inner steps its weights have moved, early in a run by far more than one would guess: measured
    on honest peers of a subspace-B run in its first rounds, stage 0's output grew 8-15x in norm over 5-7 AdamW steps
    and the last stage's input gradient shrank 4x (cosine with the anchor's down to 0.14), which is what a liar's
    scale, flip or noise looks like. No fixed band tells them apart.

    A later step is judged against its siblings (:meth:`later`): the other micro-batches of the same step went
    through the same weights, so their frames drift from the anchor's alike. Compared per token (the median over the
    frame's rows of each row's cosine and log norm ratio, :class:`Comparison`), honest siblings of one step differed
    by at most 0.20 in cosine and a factor 1.4 in norm (a 3-stage tiny model, 8 steps at learning rates 3e-3 and
    1e-2, every micro-batch of every step); a lie on one micro-batch showed 0.81-0.94 (noise), 1.35-1.44 (flip) and a
    factor 9.6-9.8 (x10). A frame is a lie when it is further than ``later_cosine`` in cosine or ``later_ratio`` in
    norm from every sibling that still says something: one whose per-token cosine with the anchor's is at least
    ``informative`` (when drift has taken every sibling further than that, the step is not judged).
    docs/security.md, "Pipeline swarms: commitments and audits", has the measurements."""

    exact: float = 0.02
    precision: float = 3.0
    stale_cosine: float = 0.5
    stale_ratio: float = 3.0
    informative: float = 0.5
    later_cosine: float = 0.4
    later_ratio: float = 3.0

    def passes(self, c: Comparison, inner: int, noise: Comparison | None = None) -> bool | None:
        """Whether a frame of inner step ``inner`` that compares as ``c`` is honest; None: a later step, which only
        its siblings can judge (:meth:`later`). ``noise``: the auditor's recomputations at its two precisions
        compared, where it made both."""
        if inner != 0:
            return None
        return c.error <= self.exact or (noise is not None and c.error <= self.precision * noise.error)

    def stale(self, c: Comparison) -> bool:
        """Whether a frame of the first step that is not exact is still near the recomputation: cosine at least
        ``stale_cosine`` and norm within ``stale_ratio``. Honest peers that served a step with the previous
        round's weights (a standby switched into the chain before it loaded the round's result) showed cosine
        0.95-0.995 and ratio 0.99-1.19; a lie of scale 10, a flip or noise shows ratio 10, cosine -1 or about 0.
        Such work is refused like a lie's, but its sender is not banned."""
        return c.cosine >= self.stale_cosine and 1 / self.stale_ratio <= c.ratio <= self.stale_ratio

    def later(self, c: Comparison, siblings: Sequence[Comparison]) -> bool | None:
        """Whether a later step's frame that compares as ``c`` is honest, judged against the same step's other
        frames (``siblings``, the same direction); None when no sibling is informative."""
        refs = [s for s in siblings if s.token_cosine >= self.informative and math.isfinite(s.token_ratio)
                and s.token_ratio > 0]
        if not refs:
            return None
        return not all(self._far(c, s) for s in refs)

    def _far(self, c: Comparison, ref: Comparison) -> bool:
        if not (math.isfinite(c.token_cosine) and math.isfinite(c.token_ratio) and c.token_ratio > 0):
            return True
        return (c.token_cosine < ref.token_cosine - self.later_cosine
                or abs(math.log(c.token_ratio / ref.token_ratio)) > math.log(self.later_ratio))


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
    # the recomputation at the auditor's other precision against its first one (made only for a frame above
    # Tolerance.exact): how far an honest peer computing in another precision may be
    forward_noise: Comparison | None = None
    backward_noise: Comparison | None = None


@dataclass(frozen=True)
class Comparison:
    """How a frame a peer sent compares with the recomputed one: the relative L2 distance, the cosine and the
    ratio of norms (sent over recomputed) of the whole micro-batch, and per token the median over the frame's rows
    (its last dimension is one token's vector) of each row's cosine and norm ratio, each in float64. The whole
    micro-batch's numbers are dominated by its few largest rows; the per-token medians are what siblings of one
    step share (:meth:`Tolerance.later`)."""

    error: float
    cosine: float
    ratio: float
    token_cosine: float = 1.0
    token_ratio: float = 1.0


def compare(sent: torch.Tensor, mine: torch.Tensor) -> Comparison:
    """:class:`Comparison` of two tensors of one shape (a frame of zeros against a zero recomputation is no error)."""
    rows_a = sent.double().reshape(-1, sent.shape[-1] if sent.dim() else 1)
    rows_b = mine.double().reshape(-1, mine.shape[-1] if mine.dim() else 1)
    ra, rb, dots = rows_a.norm(dim=1), rows_b.norm(dim=1), (rows_a * rows_b).sum(dim=1)
    na, nb, dot = float(ra.pow(2).sum().sqrt()), float(rb.pow(2).sum().sqrt()), float(dots.sum())
    diff = float((rows_a - rows_b).norm())
    error = diff / nb if nb > 0 else (0.0 if diff == 0 else math.inf)
    cosine = dot / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    ratio = na / nb if nb > 0 else (1.0 if na == 0 else math.inf)
    both = (ra > 0) & (rb > 0)
    cos = torch.where(both, dots / (ra * rb).clamp_min(1e-300), (ra == rb).double())
    ratios = torch.where(rb > 0, ra / rb.clamp_min(1e-300),
                         torch.where(ra == 0, torch.ones_like(ra), torch.full_like(ra, math.inf)))
    return Comparison(error, cosine, ratio, float(cos.median()), float(ratios.median()))


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
    weight = e.x[0].weight if e.x is not None else 1.0

    def recompute(precision: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's output (the weighted loss on the last stage) and input gradient at ``precision``."""
        stage.train(True)
        leaf = None if first else inp.to(device).detach().requires_grad_(True)
        with torch.enable_grad(), precision:
            out = run(inp.to(device) if first else leaf)
            if last:
                assert targets is not None
                out = stage.loss(out, targets.to(device)) * weight
        g = None
        if not first:
            assert leaf is not None
            grad_out = None if last else _received_grad(codec, e.g_out, out.shape)
            if last or grad_out is not None:
                (g,) = torch.autograd.grad(out, leaf, None if last else grad_out.to(device, out.dtype))
        return out.detach(), None if g is None else g.detach()

    out, g = recompute(autocast(device))
    try:
        fwd = None if last else _forward_error(codec, vocab_size, out, token_ids, e.y)
        bwd = None if g is None else _backward_error(codec, g, e.g_in)
    except _Unsigned as exc:
        return AuditResult(Finding.BAD_FRAME, inner, detail=str(exc))
    if e.x is not None and e.y is not None and split_body(e.x[1], vocab_size)[1] != split_body(e.y[1], vocab_size)[1]:
        # the token window is passed on as received, whatever the step: other targets would poison the last stage's
        # loss, and its own audit (on what it received) could not tell
        return AuditResult(Finding.FORWARD, inner, fwd, bwd, detail="it passed on other tokens than it received")
    if inner > 0:
        return AuditResult(Finding.UNJUDGED, inner, fwd, bwd)  # judged against its siblings: judge_step
    fwd_noise = bwd_noise = None
    if any(c is not None and c.error > tolerance.exact for c in (fwd, bwd)):
        other, g_other = recompute(other_precision(device))
        fwd_noise = None if fwd is None else compare(_as_sent_forward(codec, other, token_ids),
                                                     _as_sent_forward(codec, out, token_ids))
        bwd_noise = None if g is None or g_other is None else compare(_as_sent_backward(codec, g_other),
                                                                      _as_sent_backward(codec, g))
    off = [(c, f) for c, n, f in ((fwd, fwd_noise, Finding.FORWARD), (bwd, bwd_noise, Finding.BACKWARD))
           if c is not None and not tolerance.passes(c, inner, n)]
    found = Finding.CLEAN
    if off:
        far = [f for c, f in off if not tolerance.stale(c)]
        found = far[0] if far else Finding.STALE
    return AuditResult(found, inner, fwd, bwd, forward_noise=fwd_noise, backward_noise=bwd_noise)


def other_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """The precision an auditor does not train in on ``device``: float32 on CUDA (where it trains under bf16
    autocast, :func:`hlbp.peer.train.trainer.autocast`), bf16 autocast on the CPU (where it trains in float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


class _Unsigned(Exception):
    """A frame the audited peer signed does not decode: that alone convicts it."""


def _input(stage: Stage, codec: ActivationCodec, vocab_size: int,
           e: Evidence) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(the stage's input, the token ids that travel with it, the targets on the last stage) from the evidence.
    Stage 0's input is token ids: its output frame's, where its codec carries them, else the token window it
    signed with that frame (each row's first input id and its targets, the inputs shifted by one)."""
    if stage.is_first:
        assert e.y is not None
        frame, window = split_body(e.y[1], vocab_size)
        received = codec.decode_forward(frame)
        if received.token_ids is not None:
            return received.token_ids, received.token_ids, None
        ids = decode_tokens(window, (received.tensor.shape[0], received.tensor.shape[1]), vocab_size)[:, :-1]
        return ids, ids, None
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
    mine = _as_sent_forward(codec, out, token_ids)
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
    return compare(sent, _as_sent_backward(codec, g))


def _as_sent_forward(codec: ActivationCodec, out: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """Recomputed activations as they would travel: through the codec and back, as a peer's frame is compared."""
    ids = token_ids if token_ids is not None else torch.zeros(out.shape[:2], dtype=torch.long)
    return codec.decode_forward(codec.encode_forward(out.float().cpu(), ids.cpu())).tensor


def _as_sent_backward(codec: ActivationCodec, g: torch.Tensor) -> torch.Tensor:
    """A recomputed input gradient as it would travel."""
    return codec.decode_backward(codec.encode_backward(g.float().cpu())).tensor



def judge_step(results: Sequence[AuditResult], tolerance: Tolerance = Tolerance()) -> list[AuditResult]:
    """The findings on frames of one peer in one round (``results``, as :func:`audit` returned them), those of a
    later step each judged against the others of the same inner step (:meth:`Tolerance.later`), in the same order.

    Every micro-batch of a step went through the same weights, so frames that are not alike cannot all be that
    stage's output: one far from every informative sibling convicts its sender. Which of them was the lie is not
    always clear (two frames scaled alike against one honest one make the honest one the odd one out), but that
    the step's frames are not one stage's output is, and they are all signed by the peer. A result that is not
    :attr:`Finding.UNJUDGED` (a first step, a relabelled or undecodable frame) is returned as it is."""
    out = []
    for i, r in enumerate(results):
        if r.finding is not Finding.UNJUDGED:
            out.append(r)
            continue
        verdicts = []
        for name, finding in (("forward", Finding.FORWARD), ("backward", Finding.BACKWARD)):
            c = getattr(r, name)
            siblings = [getattr(o, name) for j, o in enumerate(results)
                        if j != i and o.inner == r.inner and getattr(o, name) is not None]
            if c is not None and siblings:
                verdicts.append((tolerance.later(c, siblings), finding))
        wrong = [f for ok, f in verdicts if ok is False]
        if wrong:
            out.append(replace(r, finding=wrong[0], detail="not alike the other frames of its step"))
        elif any(ok for ok, _ in verdicts):
            out.append(replace(r, finding=Finding.CLEAN))
        else:
            out.append(r)
    return out
