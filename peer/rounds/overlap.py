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

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from hlbp.peer.rounds.anchor import Anchor, Snapshot
from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.protocol.manifest import Hyperparameters
from hlbp.protocol.sparse import SparseTensor, decompress

OVERLAPS = Hyperparameters.OVERLAPS
"""How a run overlaps rounds with training (manifest ``hparams.overlap``)."""


def _scale(cfg: OuterConfig, replicas: int) -> float:
    """The weight of a peer's own contribution in its round's expected result, times the outer step."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if cfg.kind == "sparseloco":
        return cfg.alpha if cfg.aggregation == "selectors" else cfg.alpha / replicas
    return cfg.outer_lr * (1.0 + cfg.momentum) / replicas


def _held(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """What a view keeps of the parameters it reads: an anchor snapshot as it is (it reads its version back after
    later rounds), the anchor itself as a snapshot of it now, any other mapping copied (its tensors, not its later
    changes)."""
    if isinstance(params, Anchor):
        return params.snapshot()
    return params if isinstance(params, Snapshot) else dict(params)


def _dense(t: torch.Tensor | SparseTensor) -> torch.Tensor:
    return (decompress(t) if isinstance(t, SparseTensor) else t).detach().float().cpu()


Positioned = tuple[Snapshot, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]
"""A view's parameter as an anchor snapshot's value changed at some flat positions: (the snapshot, the positions
(sorted, unique, int64), the view's float32 values there given the snapshot's)."""

_NOWHERE = torch.empty(0, dtype=torch.int64)


def _same(values: torch.Tensor) -> torch.Tensor:
    return values


def _positioned(view: Mapping[str, Any], name: str) -> Positioned | None:
    """``view[name]`` as a :data:`Positioned` change of a snapshot (None: not known that way)."""
    if isinstance(view, Snapshot):
        return (view, _NOWHERE, _same) if name in view else None
    if isinstance(view, EagerStart | Previewed):
        return view.positioned(name)
    return None


def proxy_step(cfg: OuterConfig, own: Contribution, replicas: int) -> dict[str, torch.Tensor]:
    """The update a peer's own contribution is expected to cause in its round's result (float32, CPU)."""
    scale = _scale(cfg, replicas)
    return {name: scale * _dense(t) for name, t in own.tensors.items()}


class EagerStart(Mapping[str, torch.Tensor]):
    """Eager's start, ``late global - proxy step``, made one parameter at a time when it is read.

    A phase's start is read three times (loaded into the model, subtracted for the pseudo-gradient, and at each
    landing), so holding it costs a whole copy of the parameters; this holds the late global parameters (a snapshot
    of the anchor, :mod:`hlbp.peer.rounds.anchor`, read back after the round in flight replaces them; a plain
    mapping is copied) and our own sparse contribution instead (docs/design.md, "Memory"). Each read gives bit for
    bit what subtracting the proxy step in place gave."""

    def __init__(self, late_global: Mapping[str, torch.Tensor], own: Contribution, scale: float) -> None:
        self._late, self._own, self._scale = _held(late_global), own.tensors, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        start = self._late[name].detach().float().cpu()
        own = self._own.get(name)
        if own is None:
            return start
        if not isinstance(own, SparseTensor):
            return start - self._scale * _dense(own)
        # moved at the positions sent only: elsewhere x - scale * 0 is x bit for bit, and a dense proxy step would
        # cost two parameter-sized temporaries more at each read (a landing makes it while the round applies)
        out = start.clone(memory_format=torch.contiguous_format)
        if own.nnz:
            flat, at = out.view(-1), own.flat_indices()
            flat[at] = flat[at] - self._scale * own.dense_values()
        return out

    def positioned(self, name: str) -> Positioned | None:
        """This start's ``name`` as the late snapshot changed at our own sent positions, the change giving there
        bit for bit what :meth:`__getitem__` makes (None: the late parameters are no snapshot, or the contribution
        is dense)."""
        late, own = self._late, self._own.get(name)
        if not isinstance(late, Snapshot) or name not in late:
            return None
        if own is None:
            return late, _NOWHERE, _same
        if not isinstance(own, SparseTensor):
            return None
        at, values = own.flat_indices(), own.dense_values()
        order = torch.argsort(at)
        at, moved = at[order], self._scale * values[order]
        return late, at, lambda old: old - moved

    def __iter__(self) -> Iterator[str]:
        return iter(self._late)

    def __len__(self) -> int:
        return len(self._late)


class Previewed(Mapping[str, torch.Tensor]):
    """A round's result over some of its contributions, made one parameter at a time when read: per shard,
    ``SparseLoCo.apply`` of that shard's contributions to the shard's names of ``anchor`` (the names of no shard as
    the anchor has them). An eager preview is read once when it lands and once more at the phase's end, so holding
    it made would cost a copy of the parameters per preview (docs/design.md, "Memory").

    ``parts``: (outer optimizer, contributions, names) per shard."""

    def __init__(self, anchor: Mapping[str, torch.Tensor], parts: list[tuple[Any, list[Contribution], list[str]]]
                 ) -> None:
        self._anchor = _held(anchor)
        self._parts = [(outer, contributions, Subset(self._anchor, list(names))) for outer, contributions, names
                       in parts]
        self._part = {n: i for i, (_, _, shard) in enumerate(self._parts) for n in shard}
        self._weights: dict[int, list[float]] = {}  # per part, decided at its first read (over its every name)

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self._part.get(name)
        if i is None:
            return self._anchor[name]
        outer, contributions, shard = self._parts[i]
        return outer.applied(shard, contributions, name, self._weights_of(i))

    def _weights_of(self, i: int) -> list[float] | None:
        """Part ``i``'s contribution weights, decided at its first read over its every name (None: no
        contributions)."""
        outer, contributions, shard = self._parts[i]
        if i not in self._weights and contributions:
            self._weights[i] = outer.weights(contributions, list(shard))
        return self._weights.get(i)

    def positioned(self, name: str) -> Positioned | None:
        """This preview's ``name`` as the anchor snapshot changed at the positions its contributions selected, the
        change giving there bit for bit what :meth:`__getitem__` makes (None: the anchor is no snapshot, or the
        outer step is dense)."""
        snap = self._anchor
        if not isinstance(snap, Snapshot) or name not in snap:
            return None
        i = self._part.get(name)
        if i is None or not self._parts[i][1]:
            return snap, _NOWHERE, _same
        outer, contributions, _ = self._parts[i]
        step = outer.sparse_step(contributions, name, self._weights_of(i))
        if step is None:
            return None
        return snap, step.positions, step.new_values

    def __iter__(self) -> Iterator[str]:
        return iter(self._anchor)

    def __len__(self) -> int:
        return len(self._anchor)


class Subset(Mapping[str, torch.Tensor]):
    """The ``names`` of ``params``, read through (a shard's part of an :class:`EagerStart` stays lazy)."""

    def __init__(self, params: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self._params, self._names, self._known = params, names, frozenset(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LandingShift(Mapping[str, torch.Tensor]):
    """:func:`landing_shift` made one parameter at a time when it is read (``trainer.shift_params`` reads each
    once), so a landing never holds a whole-model difference."""

    def __init__(self, start: Mapping[str, torch.Tensor], new_global: Mapping[str, torch.Tensor]) -> None:
        missing = set(start) ^ set(new_global)
        if missing:
            raise ValueError(f"the start and the new global parameters differ in names: {sorted(missing)[:3]}")
        self._start, self._new = start, new_global

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._new[name].detach().float().cpu() - self._start[name].detach().float().cpu()

    def at_positions(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shift of ``name`` where it is not zero: (flat positions, sorted, unique, int64; float32 values),
        each value bit for bit :meth:`__getitem__`'s there, or None where that is not known without making the
        parameter (the views are not snapshot-based changes of one anchor, or the anchor replaced it whole).

        Both sides of a landing are the anchor at some version changed at a few positions: eager's start (our
        own sent positions), a preview (the positions its contributions selected), the round's result (the
        positions the round wrote since the start's version, from the anchor's undo records). Made at the union
        of those positions, a landing holds a few percent of a parameter instead of three whole copies (its
        start, its new value and their difference), beside a training step's state (docs/design.md, "Memory per
        parameter"). Elsewhere both sides are the same value and the difference is zero."""
        start, new = _positioned(self._start, name), _positioned(self._new, name)  # each side read once, below
        if start is None or new is None:
            return None
        (snap_a, at_a, change_a), (snap_b, at_b, change_b) = start, new
        between = snap_b.changed_since(snap_a, name)
        if between is None:
            return None
        union = torch.unique(torch.cat([at_a, at_b, between]), sorted=True)
        old, now = snap_a.values_at(name, union), snap_b.values_at(name, union)
        for values, at, change in ((old, at_a, change_a), (now, at_b, change_b)):
            where = torch.searchsorted(union, at)
            values[where] = change(values[where])
        return union, now - old

    def __iter__(self) -> Iterator[str]:
        return iter(self._start)

    def __len__(self) -> int:
        return len(self._start)


def landing_shift(start: Mapping[str, torch.Tensor], new_global: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """How far to move a phase under way when its round's result lands mid-phase: ``new_global - start``, per
    parameter (float32, CPU, made when read: :class:`LandingShift`). Added to the working parameters it keeps the
    inner steps taken so far and replaces the start (late global parameters plus the eager proxy) by the new global
    parameters, against which the phase's pseudo-gradient is then taken."""
    return LandingShift(start, new_global)


def phase_start(
    overlap: str, cfg: OuterConfig, late_global: Mapping[str, torch.Tensor], own: Contribution | None, replicas: int
) -> Mapping[str, torch.Tensor]:
    """Where the next inner phase starts under ``overlap``, given the global parameters the peer already has (one
    round late under overlap) and its own contribution to the round in flight (None: it has none, as after a
    restart or when it was left out; the start is then the late global parameters).

    No copy is made: ``late_global`` is a snapshot of the anchor, which reads its version back after the round in
    flight replaces it (:mod:`hlbp.peer.rounds.anchor`), and eager's start is an :class:`EagerStart` over it."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    if overlap == "eager" and own is not None:
        return EagerStart(late_global, own, _scale(cfg, replicas))
    return _held(late_global)
