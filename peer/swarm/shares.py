"""Several peers serving one stage in a step: the trade of their accumulated gradients (pure, no network).

When a step's micro-batches went through more than one peer of a stage (:func:`~hlbp.peer.swarm.routing.
assign_routes`), each of them accumulated a part of the stage's gradient. At the step's end they trade their parts
(``share`` messages, :mod:`hlbp.protocol.gradshare`) and each adds all of them in peer-id order, so every one of
them steps with the same bits and their weights stay equal, as one peer's would after the whole step.

:class:`Trade` is one peer's record of one step's trade: the peers it expects a share from, the shares that came,
and the checks each must pass before it is added. A share is refused when it comes from a peer that did not serve
the step, repeats a micro-batch another part already holds, or is far larger than this peer's own part (a valid
key does not make a gradient honest: :func:`share_fault`).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hlbp.protocol.gradshare import Share

SHARE_BOUND = 16.0
"""A share's gradient norm may be at most this many times the larger of two references every peer of the trade
holds: its own part (times the ratio of the micro-batch counts: early in training the micro-batches' gradients
point alike and their sum's norm grows with the count) and the stage's whole gradient of the last step it traded.
Honest parts of one step differ a lot: with identical weights, two halves of tiny's 16 micro-batches of 4 sequences
of text were measured up to 20x apart in norm (``hlbp bench pipeline --stage-peers 1,2``, real text, a few steps in),
while the step's whole gradient moved by less than 4x from one step to the next. The bound caps what a lying peer
adds to a step at a small multiple of the stage's recent gradient."""


def share_fault(share_sumsq: float, share_count: int, own_sumsq: float, own_count: int, last_sumsq: float = 0.0,
                bound: float = SHARE_BOUND) -> str | None:
    """Why a share of squared norm ``share_sumsq`` over ``share_count`` micro-batches must not be added to this
    peer's part of ``own_sumsq`` over ``own_count``, ``last_sumsq`` being the stage's whole gradient of the last step
    traded (0: none yet), or None. With neither reference (no part of its own, a zero gradient, no trade before) the
    share is taken as it is."""
    if not math.isfinite(share_sumsq):
        return "its share is not finite"
    ref = max(math.sqrt(max(own_sumsq, 0.0)) * max(1.0, share_count / max(own_count, 1)) if own_count > 0 else 0.0,
              math.sqrt(max(last_sumsq, 0.0)))
    if ref <= 0:
        return None
    limit = bound * ref
    if math.sqrt(share_sumsq) > limit:
        return (f"its share's norm {math.sqrt(share_sumsq):.4g} over {share_count} micro-batches is over {limit:.4g} "
                f"({bound:g}x this peer's own part of {own_count}, {math.sqrt(max(own_sumsq, 0.0)):.4g}, or the "
                f"stage's last traded step, {math.sqrt(max(last_sumsq, 0.0)):.4g})")
    return None


def fresh_lineage() -> bytes:
    """The lineage of optimizer state no other peer shares (a peer that started, or forgot its moments): the first
    trade with it makes every peer of the trade forget theirs."""
    return os.urandom(32)


def next_lineage(lineage: bytes, session: int, step: int, peers: Sequence[str]) -> bytes:
    """The lineage after applying step (``session``, ``step``) with ``peers`` serving the stage. Two peers whose
    lineages are equal applied the same steps, with the same gradients, since their AdamW moments were last cleared
    together, so their moments are equal too."""
    tag = f"{session}:{step}:{','.join(sorted(peers))}".encode()
    return hashlib.sha256(lineage + tag).digest()


def joint_lineage(session: int, step: int, peers: Sequence[str]) -> bytes:
    """The lineage every peer of a trade starts from when their lineages differed: all of them clear their moments
    before the step, so all of them hold the same (empty) state."""
    return next_lineage(b"joint", session, step, peers)


def sumsq_of(grads: Mapping[str, torch.Tensor]) -> float:
    """The squared norm of a share's gradient, in double precision."""
    return float(sum(g.double().pow(2).sum() for g in grads.values()))


def add_in_order(parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sum of every peer's part (peer id -> name -> gradient), added in peer-id order so that every peer that
    adds the same parts gets the same bits."""
    order = sorted(parts)
    total = {name: t.detach().clone() for name, t in parts[order[0]].items()}
    for peer in order[1:]:
        for name, t in parts[peer].items():
            total[name].add_(t.to(total[name].device))
    return total


@dataclass
class Trade:
    """One peer's trade of one step: ``me`` holds ``own`` micro-batches of ``count``, and expects a share from every
    peer of ``expected`` (the other peers that served its stage in the step)."""

    me: str
    count: int
    own: frozenset[int]
    expected: frozenset[str]
    shares: dict[str, Share] = field(default_factory=dict)
    not_finite: bool = False  # a part (this peer's or a share) was not finite: the step is skipped

    def fault(self, peer: str, share: Share, own_sumsq: float, last_sumsq: float = 0.0) -> str | None:
        """Why ``peer``'s ``share`` must not be taken, or None (then it is recorded); ``last_sumsq``: the stage's
        whole gradient of the last step traded (:func:`share_fault`)."""
        if peer not in self.expected:
            return "a share from a peer that did not serve this stage in the step"
        if peer in self.shares:
            return "a second share of the same step"
        held = set(self.own).union(*(s.mbs for s in self.shares.values()))
        if held & share.mbs:
            return f"a share of micro-batches {sorted(held & share.mbs)[:4]} already accumulated"
        if share.grads is not None:
            fault = share_fault(sumsq_of(share.grads), len(share.mbs), own_sumsq, len(self.own), last_sumsq)
            if fault is not None:
                return fault
        self.shares[peer] = share
        self.not_finite |= share.grads is None
        return None

    def complete(self) -> bool:
        """Every expected share came and, with this peer's part, they cover every micro-batch of the step once."""
        covered = set(self.own).union(*(s.mbs for s in self.shares.values()))
        return set(self.shares) == set(self.expected) and covered == set(range(self.count))

    def missing(self) -> Collection[str]:
        """The peers whose share has not come."""
        return sorted(self.expected - set(self.shares))

    def total(self, own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The stage's gradient of the whole step: every part added in peer-id order (None: a part was not
        finite, the step is skipped)."""
        if self.not_finite or any(s.grads is None for s in self.shares.values()):
            return None
        parts: dict[str, Mapping[str, torch.Tensor]] = {p: s.grads for p, s in self.shares.items()
                                                        if s.grads is not None}
        parts[self.me] = own
        return add_in_order(parts)
