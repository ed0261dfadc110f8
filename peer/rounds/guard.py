"""Bounds on what one round may do to the global parameters: the defence against well-formed, signed, finite lies.

A contribution that decodes cleanly can still be poison: values scaled by 10⁶, or a 2-bit lookup table of 10³⁰.
Median-norm clipping (:class:`hlbp.peer.rounds.outer.OuterConfig` ``clip_median``) bounds each contribution's
*influence* to the round's median norm; this module adds two hard bounds, both relative to the shard's own scale
(the norm of its global parameters θ_s, which every in-sync peer holds bit for bit):

1. per contribution: ‖Δ̂_r‖ ≤ ``max_contribution_ratio`` · ‖θ_s‖. Beyond it the contribution is not clipped but
   refused and its sender banned, by the coordinator before it accepts and by every peer before it applies;
2. per round, before commit: the new parameters are finite, ‖θ_s(t+1) − θ_s(t)‖ ≤ ``max_update_ratio`` ·
   ‖θ_s(t)‖, and (where the runner has the run's fixed guard batch) the loss on it did not jump by more than
   ``max_loss_jump`` times in one round, nor climb to ``max_loss_rise`` times the lowest of the last few rounds.
   A round that fails is refused as a whole: nobody's parameters move.

Every function here is pure and computes in float64 from the same accepted set and the same anchor, so every
in-sync peer reaches the same verdict and the shard checksums still agree. The bounds are loose on purpose:
honest runs stay more than an order of magnitude below them (README, "Hostile peers", gives the measured ratios).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hlbp.peer.common.spill import stream_of
from hlbp.peer.rounds.outer import Contribution
from hlbp.protocol.sparse import SparseTensor

MIN_SCALE = 1e-3  # a shard norm below this (a zero-initialised shard) is taken as this, so bounds stay positive


@dataclass(frozen=True)
class GuardConfig:
    """The run's bounds; the manifest's hyperparameters carry them so that every peer applies the same ones."""

    max_contribution_ratio: float = 8.0  # ‖Δ̂_r‖ / ‖θ_s‖ above this: refused, sender banned (honest: ≤ 0.7)
    max_loss_jump: float = 10.0  # guard-batch loss after the step above this times the last one: round refused
    max_update_ratio: float = 8.0  # ‖θ(t+1) − θ(t)‖ / ‖θ(t)‖ of a shard above this: round refused (honest: ≤ 0.82)
    # guard-batch loss above this times the lowest of the last LOSS_WINDOW committed rounds: refused (a slow climb,
    # each step under max_loss_jump, is caught once it adds up to this)
    max_loss_rise: float = 2.0
    # ‖Δ̂_r‖ above this times the median of the round's contributions to the shard (three or more): refused, sender
    # banned. A poisoner just under max_contribution_ratio sends more than ten times an honest norm; honest peers of
    # one round differ by less than this even when one of them caught up with fewer steps
    max_vs_median: float = 8.0


MIN_FOR_MEDIAN = 3  # contributions a shard needs before the median says what an honest norm is


LOSS_WINDOW = 8  # committed rounds whose guard-batch losses a slow climb is measured against


CHUNK = 1 << 18  # elements summed in float64 at a time: 2 MiB of temporaries, whatever the parameter's size
# (a block of a kept tensor, :data:`hlbp.peer.common.spill.BLOCK_BYTES`, holds a whole number of chunks, so a norm
# read a block at a time sums the same chunks in the same order as one read whole)


def _square_sum(t: torch.Tensor, minus: torch.Tensor | None = None) -> float:
    """Σ (t − minus)² in float64 (inf if a value is not finite), a chunk of :data:`CHUNK` elements at a time: a
    whole parameter's float64 copy was 8 bytes per element, and during a round that overlaps training such
    temporaries left the heap holding many times the model (docs/design.md, "Memory per parameter")."""
    flat = t.detach().reshape(-1)
    other = minus.detach().reshape(-1) if minus is not None else None
    total = 0.0
    for i in range(0, flat.numel(), CHUNK):
        d = flat[i:i + CHUNK].double()
        if other is not None:
            d.sub_(other[i:i + CHUNK])
        if not bool(torch.isfinite(d).all()):
            return math.inf
        total += float(d.square_().sum())
    return total


def norm(tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> float:
    """The float64 Euclidean norm over ``names`` of ``tensors`` (every tensor when None); inf if any value is not
    finite. A tensor kept in a file is read a block at a time (:func:`~hlbp.peer.common.spill.stream_of`), not
    whole: the anchor's norm is taken by the exchange thread while a training step runs beside it, and a whole
    read of every parameter at once was a model-sized transient at the step's peak."""
    total = 0.0
    for name in tensors if names is None else names:
        for block in stream_of(tensors, name).blocks:
            total += _square_sum(block)
            if not math.isfinite(total):
                return math.inf
    return math.sqrt(total)


def contribution_norm(c: Contribution) -> float:
    """‖Δ̂_r‖ of a decoded contribution (sparse values as the receiver reconstructs them, or dense tensors)."""
    return norm({n: t.dense_values() if isinstance(t, SparseTensor) else t for n, t in c.tensors.items()})


def scale(anchor: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> float:
    """The shard's scale: ‖θ_s‖ over ``names`` of ``anchor`` (all of it when None), at least :data:`MIN_SCALE`."""
    return max(norm(anchor, names), MIN_SCALE)


def oversized(norms: Mapping[str, float], shard_scale: float, cfg: GuardConfig) -> dict[str, float]:
    """Senders whose contribution breaks bound 1, with their ratio ‖Δ̂_r‖ / ‖θ_s‖ (inf when not finite)."""
    out = {}
    for sender, n in norms.items():
        ratio = n / shard_scale
        if not ratio <= cfg.max_contribution_ratio:  # also catches NaN
            out[sender] = ratio
    return out


def outliers(norms: Mapping[str, float], cfg: GuardConfig) -> dict[str, float]:
    """Senders whose contribution norm is above ``max_vs_median`` times the median of the others left, with that
    ratio: removed largest first until the rest holds none, so the coordinator that drops them and every peer that
    checks the accepted set reach the same verdict. Below :data:`MIN_FOR_MEDIAN` contributions nothing is an outlier
    (with two, either could be the honest one)."""
    left, out = dict(norms), {}
    while len(left) >= MIN_FOR_MEDIAN:
        med = sorted(left.values())[(len(left) - 1) // 2]  # the lower median: exact, the same everywhere
        if not med > 0:
            break
        worst = max(left, key=lambda p: (left[p], p))
        if left[worst] <= cfg.max_vs_median * med:
            break
        out[worst] = left.pop(worst) / med
    return out


def squared_change(new: torch.Tensor, old: torch.Tensor) -> float:
    """‖new − old‖² of one parameter in float64 (inf if ``new`` holds a non-finite value): a round's update
    measured one parameter at a time, as it replaces each (``update_ratio`` is its square root over a shard,
    divided by the shard's :func:`scale`)."""
    return _square_sum(new, old)


def ratio_of(moved: float, shard_scale: float) -> float:
    """The update ratio from a shard's summed :func:`squared_change` and its :func:`scale` before the round (inf
    when the sum is not finite): what the applier computes as it replaces each parameter."""
    return math.sqrt(moved) / shard_scale if math.isfinite(moved) else math.inf


def update_ratio(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """‖new − old‖ / ‖old‖ over a shard (inf if ``new`` holds a non-finite value), one parameter's difference at a
    time: the shard's update is never held whole (docs/design.md, "Memory per parameter")."""
    return ratio_of(sum(squared_change(new[n], old[n]) for n in old), scale(old))


def refuse_reason(ratio: float, cfg: GuardConfig) -> str | None:
    """Why a round whose update has ``ratio`` (:func:`update_ratio`) must be refused, or None if it may commit."""
    if not math.isfinite(ratio):
        return "the new parameters are not finite"
    if ratio > cfg.max_update_ratio:
        return f"the update's norm is {ratio:.3g}x the parameters' (bound {cfg.max_update_ratio:g}x)"
    return None


@dataclass(frozen=True)
class LossCheck:
    """How a peer applies the loss guard to one round (:func:`loss_check`)."""

    score: bool  # score the round's result on the guard batch (else the norm bounds alone judge it)
    anchor: bool  # score the anchor first, what the result is judged against (no last rounds' losses to use)
    blame: bool  # on a refusal, ban the largest contribution (only a peer that saw every shard's can tell)


def loss_check(held: int, n_shards: int, member_shards: Sequence[int], has_window: bool) -> LossCheck:
    """The loss guard's plan for a peer holding ``held`` of ``n_shards`` shards, in a round whose accepted members
    contributed ``member_shards`` shards each, with (``has_window``) or without its last rounds' guard losses.

    A peer holding every shard scores the result itself, against the anchor's loss when it has no last rounds'.
    A stage peer's score is its swarm's (the whole model's, through its chain), asked for only in a round without a
    full replica: one in the accepted set runs the guard on every shard and its votes decide them, and the rule
    reads only the accepted set, so every stage of a chain asks or none does; it never scores the anchor (its chain
    would have to agree on that too) and never blames, since shards it does not hold move the loss as much."""
    whole = held == n_shards
    if whole:
        return LossCheck(score=True, anchor=not has_window, blame=True)
    return LossCheck(score=not any(n == n_shards for n in member_shards), anchor=False, blame=False)


def loss_reason(recent: Sequence[float], loss: float, cfg: GuardConfig) -> str | None:
    """Why a round whose new parameters score ``loss`` on the run's fixed guard batch must be refused, or None.

    The guard batch is the same for every peer and so are the parameters, so the verdict is too (factors of 2 and
    10 leave float differences between machines far from the edge). ``recent`` are the guard losses of the last
    committed rounds, oldest first (empty right after a start or a sync: then only finiteness is checked). A jump
    of ``max_loss_jump`` over the last one is refused, and so is a slow climb: ``max_loss_rise`` over the lowest of
    the last :data:`LOSS_WINDOW`, which a poisoner growing the loss a little each round reaches within a few rounds.
    """
    if not math.isfinite(loss):
        return "the loss on the guard batch is not finite"
    window = [x for x in recent[-LOSS_WINDOW:] if math.isfinite(x)]
    if not window:
        return None
    if loss > cfg.max_loss_jump * window[-1]:
        return (f"the loss on the guard batch jumped from {window[-1]:.4g} to {loss:.4g} "
                f"(bound {cfg.max_loss_jump:g}x)")
    if loss > cfg.max_loss_rise * min(window):
        return (f"the loss on the guard batch climbed to {loss:.4g}, {loss / min(window):.3g}x the lowest of the "
                f"last {len(window)} rounds (bound {cfg.max_loss_rise:g}x)")
    return None


def culprits(norms: Mapping[str, float], k: int = 1) -> list[str]:
    """The senders to blame for a refused round that no single bound caught: the ``k`` largest norms (ties: the
    smallest sender id), so every peer names the same ones."""
    ranked: Sequence[str] = sorted(norms, key=lambda s: (-(norms[s] if not math.isnan(norms[s]) else math.inf), s))
    return list(ranked[:k])
