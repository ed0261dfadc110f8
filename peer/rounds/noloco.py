"""NoLoCo's outer step: no all-reduce and no coordinator; each round a replica averages with one partner.

NoLoCo ("No-all-reduce Low Communication Training Method for Large Models", 2025) replaces the round's collective
with pairs. Every H inner steps the replicas are matched in pairs by a permutation that each of them derives from
the run's seed and the round (:func:`partners`: no message decides it); each pair swaps its outer weights φ and its
progress d = θ − φ (θ: where the inner steps took the replica), and each replica then takes a modified Nesterov
step that moves it along the pair's mean progress and pulls it toward the pair's mean weights::

    m ← α·m + β·d̄ + γ·(φ̄ − φ_i);   φ ← φ + m;   θ ← φ

(α = 0.5, β = γ = 0.7 as in ../shared/design/ALGORITHMS.md §4; an unpaired replica, or one whose partner did not
answer in time, takes the step alone: d̄ = d_i, φ̄ = φ_i). Replicas never become identical: the pull keeps them
close, and how close is measured (the spread, :func:`spread`), not assumed.

**Sparse NoLoCo** (this project's; none of the anchors has it) sends SparseLoCo's payload instead of two dense
tensors: the chunked top-k of the progress plus an error-feedback buffer, 2-bit values, and φ's own values at the
positions sent (fp32). The pair's mean progress is the mean of the two decoded payloads, which both sides compute
alike; the pull acts where the partner's φ is known, on the partner's positions: each side pulls toward the
other where the other moved most. What is not sent stays in the error feedback, as in SparseLoCo.

Pure functions and one small state object per replica; the engines (in-process and, later, the network) move
the messages.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.protocol import ProtocolError
from hlbp.protocol.sparse import SMALL_TENSOR_RULES, SparseTensor, compress, decompress, tensor_k

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class NoLoCoConfig:
    """The outer step's coefficients and, for sparse NoLoCo, its payload (the run manifest fixes them)."""

    momentum: float = 0.5  # α: decay of the outer momentum
    progress_lr: float = 0.7  # β: step along the pair's mean progress
    pull: float = 0.7  # γ: pull toward the pair's mean outer weights
    sparse: bool = False  # SparseLoCo's payload (top-k progress with error feedback, φ at those positions)
    k: int = 64  # sparse: values kept per 4096
    quant_bits: int | None = 2  # sparse: 2-bit values with a lookup table, or None for fp32 values
    ef_decay: float = 0.95  # sparse: error-feedback decay
    small_tensors: str = "topk"
    # a partner's say, per tensor, against our own progress's norm: its progress at most this many times it (honest
    # pairs measured at most 2.7x on tiny), the pull toward its weights at most this many times it (honest: 3.4x
    # with 4 replicas over 12 rounds, 11x with 8 replicas in their sixth round, as the replicas spread early on; a
    # bound above that let a partner lying about its weights take honest losses from 8.8 to 25, docs/security.md)
    progress_bound: float = 4.0
    pull_bound: float = 8.0

    def validate(self) -> None:
        if not 0 <= self.momentum < 1:
            raise UserInputError(f"NoLoCo momentum must be in [0, 1), got {self.momentum}")
        if not (0 < self.progress_lr <= 2 and 0 <= self.pull <= 1):
            raise UserInputError("NoLoCo progress_lr must be in (0, 2] and pull in [0, 1]")
        if not 1 <= self.k <= 4096 or not 0 <= self.ef_decay < 1:
            raise UserInputError("NoLoCo k must be in 1..4096 and ef_decay in [0, 1)")
        if not (self.progress_bound > 0 and self.pull_bound > 0):
            raise UserInputError("NoLoCo progress_bound and pull_bound must be positive")
        if self.small_tensors not in SMALL_TENSOR_RULES:
            raise UserInputError(f"small_tensors must be one of {SMALL_TENSOR_RULES}, got {self.small_tensors!r}")

    @property
    def label(self) -> str:
        return f"sparse k={self.k}" if self.sparse else "dense"


def partners(peers: Sequence[str], seed: str, round_: int) -> dict[str, str | None]:
    """Each peer's partner in ``round_`` (None: unpaired, the odd one out): the peers in an order shuffled by a
    generator seeded from ``seed`` and the round, matched first with second, third with fourth... Every peer that
    knows the same peers computes the same pairs, so no message decides them; a different round, a different
    matching."""
    order = sorted(set(peers))
    rng = random.Random(hashlib.sha256(f"noloco|{seed}|{round_}".encode()).digest())
    rng.shuffle(order)
    out: dict[str, str | None] = {}
    for i in range(0, len(order) - 1, 2):
        out[order[i]], out[order[i + 1]] = order[i + 1], order[i]
    if len(order) % 2:
        out[order[-1]] = None
    return out


@dataclass
class PairMessage:
    """What a replica sends its partner for one round: its progress (dense, or SparseLoCo-compressed) and its outer
    weights φ (dense: all of them; sparse: the values at the positions its progress carries, flat)."""

    progress: dict[str, torch.Tensor] | dict[str, SparseTensor]
    phi: dict[str, torch.Tensor]

    def progress_dense(self, name: str) -> torch.Tensor:
        t = self.progress[name]
        return decompress(t) if isinstance(t, SparseTensor) else t.float()

    def nbytes(self) -> int:
        """Bytes of the tensors' data (the wire adds headers; sparse: indices, codes, table and φ's values)."""
        total = 0
        for t in self.progress.values():
            if isinstance(t, SparseTensor):
                parts = (t.indices, t.codes, t.table, t.values)
                total += sum(p.numel() * p.element_size() for p in parts if p is not None)
            else:
                total += t.numel() * t.element_size()
        return total + sum(t.numel() * t.element_size() for t in self.phi.values())


@dataclass
class NoLoCoState:
    """One replica's outer state: its outer weights φ, its outer momentum m and (sparse) its error feedback."""

    phi: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    ef: dict[str, torch.Tensor] = field(default_factory=dict)
    bounded: int = 0  # tensors of partners' messages scaled down to the bounds so far (an honest run: none)

    @classmethod
    def start(cls, params: Tensors) -> NoLoCoState:
        """The state of a replica whose outer weights are ``params`` (float32 copies on the CPU)."""
        return cls({n: t.detach().float().cpu().clone() for n, t in params.items()})


def message(state: NoLoCoState, theta: Tensors, cfg: NoLoCoConfig) -> PairMessage:
    """This replica's message for the round, from where its inner steps took it (``theta``). Sparse: the top-k of
    the error-feedback buffer plus this phase's progress is sent and taken out of the buffer (the rest waits)."""
    progress: dict[str, torch.Tensor] | dict[str, SparseTensor] = {}
    phi: dict[str, torch.Tensor] = {}
    for name, p in state.phi.items():
        d = theta[name].detach().float().cpu() - p
        if not cfg.sparse:
            progress[name] = d  # type: ignore[assignment]
            phi[name] = p.clone()  # the message outlives our step, which moves φ in place
            continue
        e = state.ef.get(name)
        e = d if e is None else e.mul_(cfg.ef_decay).add_(d)
        s = compress(e, tensor_k(tuple(e.shape), cfg.k, cfg.small_tensors), cfg.quant_bits)
        e.sub_(decompress(s))
        state.ef[name] = e
        progress[name] = s  # type: ignore[assignment]
        phi[name] = p.reshape(-1)[s.flat_indices()].clone()
    return PairMessage(progress, phi)


def _bounded(t: torch.Tensor, limit: float) -> tuple[torch.Tensor, bool]:
    """``t`` scaled down to norm ``limit`` when it is longer; and whether it was."""
    norm = float(t.norm())
    return (t * (limit / norm), True) if norm > limit else (t, False)


def step(state: NoLoCoState, mine: PairMessage, partner: PairMessage | None, cfg: NoLoCoConfig) -> dict[str, torch.Tensor]:
    """The outer step after the swap: updates ``state`` (φ and m) and returns the new φ, which the inner phase
    starts from (θ ← φ). ``partner`` None: no partner this round, the step is taken alone.

    A partner is hostile like anything from the network: well-formed, finite and signed, its message can still be
    poison. Its say is bounded against our own scale, per tensor: its progress is scaled down to at most
    ``progress_bound`` times the norm of ours, and the pull toward its weights to at most ``pull_bound`` times it,
    so one round with a lying partner moves us at most (β·(1 + progress_bound) + γ·pull_bound)/2 times our own progress
    further than an honest one would (docs/security.md)."""
    a, b, g = cfg.momentum, cfg.progress_lr, cfg.pull
    for name, p in state.phi.items():
        d = mine.progress_dense(name)
        pull = torch.zeros_like(p)
        if partner is not None:
            own = float(d.norm())
            theirs_d, cut_d = _bounded(partner.progress_dense(name), cfg.progress_bound * own)
            d = 0.5 * (d + theirs_d)
            theirs = partner.phi[name]
            if cfg.sparse:
                t = partner.progress[name]
                assert isinstance(t, SparseTensor)
                idx = t.flat_indices()
                gap, cut_p = _bounded(theirs - p.reshape(-1)[idx], cfg.pull_bound * own)
                pull.view(-1)[idx] = 0.5 * gap
            else:
                gap, cut_p = _bounded(theirs - p, cfg.pull_bound * own)
                pull = 0.5 * gap
            state.bounded += cut_d + cut_p
        m = state.momentum.get(name)
        upd = b * d + g * pull
        m = upd if m is None else m.mul_(a).add_(upd)
        state.momentum[name] = m
        p.add_(m)
    return {n: t.clone() for n, t in state.phi.items()}


def check_message(msg: PairMessage, shapes: Mapping[str, tuple[int, ...]], cfg: NoLoCoConfig) -> None:
    """Raise :class:`ValueError` unless ``msg`` is a message of this run's shapes and kind with finite values: a
    partner's message is hostile like everything from the network (what it can still do: docs/security.md)."""
    if set(msg.progress) != set(shapes) or set(msg.phi) != set(shapes):
        raise ValueError("a NoLoCo message names other tensors than the model's")
    for name, shape in shapes.items():
        t, phi = msg.progress[name], msg.phi[name]
        if cfg.sparse:
            if not isinstance(t, SparseTensor) or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: not a sparse progress of shape {shape}")
            if phi.shape != (t.flat_indices().numel(),):
                raise ValueError(f"{name}: {phi.numel()} outer weights for {t.flat_indices().numel()} positions")
            values = decompress(t)
        else:
            if isinstance(t, SparseTensor) or tuple(t.shape) != tuple(shape) or tuple(phi.shape) != tuple(shape):
                raise ValueError(f"{name}: not a dense progress and outer weights of shape {shape}")
            values = t
        if not (bool(torch.isfinite(values).all()) and bool(torch.isfinite(phi).all())):
            raise ValueError(f"{name}: values that are not finite")


def _codecs(cfg: NoLoCoConfig) -> tuple[OuterConfig, OuterConfig]:
    """The wire formats of a message's two parts: its progress (SparseLoCo's, or dense fp32) and φ (dense fp32)."""
    dense = OuterConfig(kind="diloco", wire_dtype="fp32")
    if not cfg.sparse:
        return dense, dense
    return OuterConfig(kind="sparseloco", k=cfg.k, quant_bits=cfg.quant_bits, small_tensors=cfg.small_tensors), dense


def message_to_bytes(msg: PairMessage, cfg: NoLoCoConfig, sender: str, run: str, round_: int) -> bytes:
    """A message framed for the wire: the progress envelope, length-prefixed, then φ's (the round's shard 0)."""
    progress_cfg, phi_cfg = _codecs(cfg)
    head = contribution_to_bytes(Contribution(sender, 0, msg.progress), progress_cfg, run=run, round=round_, shard=0)
    tail = contribution_to_bytes(Contribution(sender, 0, msg.phi), phi_cfg, run=run, round=round_, shard=0)
    return struct.pack(">Q", len(head)) + head + tail


def message_from_bytes(data: bytes, cfg: NoLoCoConfig, shapes: Mapping[str, tuple[int, ...]], run: str,
                       round_: int) -> PairMessage:
    """A partner's message from untrusted bytes: each part parsed against the run, round and shapes (φ's against
    the positions the progress names), then :func:`check_message`; any defect raises :class:`ProtocolError`."""
    if len(data) < 8:
        raise ProtocolError("a NoLoCo message shorter than its length prefix")
    (n,) = struct.unpack(">Q", data[:8])
    if n > len(data) - 8:
        raise ProtocolError("a NoLoCo message whose progress runs past its end")
    progress_cfg, phi_cfg = _codecs(cfg)
    progress = contribution_from_bytes(data[8:8 + n], progress_cfg, shapes, run=run, round=round_, shard=0).tensors
    if cfg.sparse:
        phi_shapes = {k: (v.flat_indices().numel(),) for k, v in progress.items()  # type: ignore[union-attr]
                      if isinstance(v, SparseTensor)}
    else:
        phi_shapes = dict(shapes)
    phi = contribution_from_bytes(data[8 + n:], phi_cfg, phi_shapes, run=run, round=round_, shard=0).tensors
    msg = PairMessage(progress, {k: v.float() for k, v in phi.items()})  # type: ignore[arg-type]
    try:
        check_message(msg, shapes, cfg)
    except ValueError as exc:
        raise ProtocolError(f"NoLoCo message: {exc}") from None
    return msg


def spread(phis: Sequence[Tensors]) -> float:
    """How far apart the replicas' outer weights are: the root mean square distance of each from their mean, over
    the mean's norm (0: identical replicas)."""
    if len(phis) < 2:
        return 0.0
    sq = norm = 0.0
    for name in phis[0]:
        stack = torch.stack([p[name].float() for p in phis])
        mean = stack.mean(0)
        sq += float((stack - mean).pow(2).sum()) / len(phis)
        norm += float(mean.pow(2).sum())
    return math.sqrt(sq / max(norm, 1e-30))
