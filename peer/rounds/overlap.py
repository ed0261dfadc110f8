"""Overlapping a round's exchange with the next inner phase: where that phase starts (pure, no I/O).

Without overlap (``"none"``) a replica waits for round r's result and starts phase r+1 from the new global
parameters. With overlap it starts phase r+1 at once, while round r is still being exchanged, so the global
parameters it can start from are one round late (they include rounds up to r-1):

- ``"naive"`` starts from those late global parameters as they are. Every replica's own latest progress is missing
  from its start, which costs loss (+12.7 % at H = 30 in Kale et al., arXiv 2502.12996).
- ``"eager"`` starts from the late global parameters moved by the replica's *own* round-r contribution, at the
  weight that contribution is expected to have in round r's result (times the outer step).
  Its own fresh progress stands in for round r until the round's result arrives. With a plain SGD outer step this
  is the paper's eager update: the others' contributions one round late, its own without delay.

Either way the global parameters themselves advance only by each round's accepted set, one round late, identically
on every in-sync peer, so their checksums still agree; the start point is a peer's private working copy. The
pseudo-gradient of phase r+1 is taken against that start, so the proxy never enters a contribution.

Adapted to SparseLoCo: the proxy is the peer's own *sent* contribution (decompressed, exactly what every receiver
reconstructs), not its raw pseudo-gradient, because what it did not send stays in its error-feedback buffer and
enters later rounds. The weight follows the aggregation. Under the paper's 1/R mean it is 1/R. Under the mean over
selectors (the default) a coordinate's result is the mean of the values of the replicas that selected it, and a
peer's own value is its best guess of that mean, so the weight is 1. The 1/R weight there left eager no better
than naive delay: measured over 30 rounds at 100 ms RTT (tiny, 4 replicas, H = 20), +8.5 % against naive's
+7.7 %, because with top-k at about 1.5 % density most of a peer's coordinates are selected by it alone. For
DiLoCo the proxy is the Nesterov step of a fresh momentum, ``outer_lr * (1 + momentum) / R`` times the
pseudo-gradient; the global momentum stays in the late global update.

Landing. Under ``eager`` the round's result does not wait for the phase's end: as soon as the exchange finishes
(measured: on average about halfway into the next phase), the working parameters move by ``new global - start``
(:func:`landing_shift`), keeping the inner steps taken so far, and the phase's pseudo-gradient is taken against the
new global parameters. Only the steps before the landing trained from the late start. This is the merge of
Streaming DiLoCo (Douillard et al., arXiv 2501.18512) applied to eager's start; naive delay does not land, so it
stays the paper's one-round baseline.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.protocol.manifest import Hyperparameters
from hlbp.protocol.sparse import SparseTensor, decompress

OVERLAPS = Hyperparameters.OVERLAPS
"""How a run overlaps rounds with training (manifest ``hparams.overlap``)."""


def proxy_step(cfg: OuterConfig, own: Contribution, replicas: int) -> dict[str, torch.Tensor]:
    """The update a peer's own contribution is expected to cause in its round's result (float32, CPU)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if cfg.kind == "sparseloco":
        scale = cfg.alpha if cfg.aggregation == "selectors" else cfg.alpha / replicas
    else:
        scale = cfg.outer_lr * (1.0 + cfg.momentum) / replicas
    out = {}
    for name, t in own.tensors.items():
        dense = decompress(t) if isinstance(t, SparseTensor) else t
        out[name] = scale * dense.detach().float().cpu()
    return out


def landing_shift(start: Mapping[str, torch.Tensor], new_global: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How far to move a phase under way when its round's result lands mid-phase: ``new_global - start``, per
    parameter (float32, CPU). Added to the working parameters it keeps the inner steps taken so far and replaces the
    start (late global parameters plus the eager proxy) by the new global parameters, against which the phase's
    pseudo-gradient is then taken."""
    missing = set(start) ^ set(new_global)
    if missing:
        raise ValueError(f"the start and the new global parameters differ in names: {sorted(missing)[:3]}")
    return {n: new_global[n].detach().float().cpu() - start[n].detach().float().cpu() for n in start}


def phase_start(
    overlap: str, cfg: OuterConfig, late_global: Mapping[str, torch.Tensor], own: Contribution | None, replicas: int
) -> dict[str, torch.Tensor]:
    """Where the next inner phase starts under ``overlap``, given the global parameters the peer already has (one
    round late under overlap) and its own contribution to the round in flight (None: it has none, as after a
    restart or when it was left out; the start is then the late global parameters)."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    start = {n: t.detach().float().cpu().clone() for n, t in late_global.items()}
    if overlap == "eager" and own is not None:
        for name, step in proxy_step(cfg, own, replicas).items():
            start[name].sub_(step)
    return start
