"""Outer optimizers: SparseLoCo (sparse, 2-bit, error feedback) and DiLoCo (dense Nesterov), per shard.

The round protocol drives both through one interface:

1. ``contribute(anchor, local)``: this replica's message for the round, from the global parameters it started
   the round at (``anchor``) and where its inner steps took it (``local``).
2. ``apply(anchor, contributions)``: the next global parameters from the accepted contributions.
3. ``withdraw(contribution)``: the round closed without this replica's contribution; keep it for later.

Both work on any set of named tensors, so a stage peer runs them on its own shard alone. ``apply`` is
deterministic given the contributions in the same order; callers sort contributions canonically (by sender) so
that every in-sync peer computes bit-identical parameters.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.spill import SpilledTensors, Streamed, stream_of
from hlbp.peer.train.adamw import STATE_DTYPES
from hlbp.protocol.sparse import SMALL_TENSOR_RULES, SparseTensor, compress, tensor_k

Tensors = Mapping[str, torch.Tensor]


class Prefixed(Mapping[str, torch.Tensor]):
    """``tensors`` under the names ``prefix + name``, each read from ``tensors`` when asked for."""

    def __init__(self, tensors: Tensors, prefix: str) -> None:
        self.tensors, self.prefix = tensors, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        if not key.startswith(self.prefix):
            raise KeyError(key)
        return self.tensors[key[len(self.prefix):]]

    def stream(self, key: str) -> Streamed:
        """Tensor ``key`` a block at a time where the mapping underneath can hand it out so."""
        if not key.startswith(self.prefix):
            raise KeyError(key)
        return stream_of(self.tensors, key[len(self.prefix):])

    def __iter__(self) -> Iterator[str]:
        return (self.prefix + n for n in list(self.tensors))

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.startswith(self.prefix) and key[len(self.prefix):] in self.tensors


@dataclass
class OuterConfig:
    """Outer optimizer settings; the run manifest fixes them for every peer."""

    kind: Literal["sparseloco", "diloco"] = "sparseloco"
    # SparseLoCo
    k: int = 64  # values kept per 4096 (1.56 % density)
    beta: float = 0.95  # error-feedback decay
    alpha: float = 1.0  # outer learning rate (plain SGD on the aggregated pseudo-gradient)
    quant_bits: int | None = 2  # 2-bit values with a lookup table, or None for fp32 values
    aggregation: Literal["mean", "selectors"] = "mean"  # paper's 1/R mean, or reference code's mean over selectors
    clip_median: bool = False  # scale each contribution to at most the median contribution norm
    token_weighted: bool = False  # weight contributions by tokens processed instead of equally
    # the most tokens one contribution's weight may claim: what H inner steps of the manifest's batch hold (0: no
    # cap). A claimed count is the sender's word; without a cap a claim of 2**40 made the round its own
    max_tokens: int = 0
    small_tensors: str = "topk"  # 1-D and sub-chunk tensors: the run's k, or "dense" (every value, 2-bit)
    # a contribution after m phases left out (a gather set without room, a straggler): "average" sends the top-k of
    # the buffer over m and clears those positions' whole backlog, so it moves the model as one phase does but
    # carries all m; "sum" sends the top-k of the buffer as it is (m phases' worth of step; docs/algorithms.md §1)
    backlog: Literal["average", "sum"] = "average"
    # how this peer stores its error-feedback buffer (its own state, never sent or checksummed): "bf16" halves it
    # (2 bytes per parameter instead of 4); each round's arithmetic runs in float32 on one parameter at a time
    ef_dtype: Literal["fp32", "bf16"] = "fp32"
    # where: "" in memory, else a file under this directory (hlbp.peer.common.spill: read and written one parameter
    # at a time, once a round, so the process does not hold it between rounds)
    ef_dir: str = ""
    # DiLoCo
    outer_lr: float = 0.7  # Nesterov SGD learning rate
    momentum: float = 0.9  # Nesterov momentum
    wire_dtype: Literal["fp32", "bf16"] = "fp32"  # dense wire format of the pseudo-gradient

    def validate(self) -> None:
        if self.kind not in ("sparseloco", "diloco"):
            raise UserInputError(f"outer optimizer must be sparseloco or diloco, got {self.kind!r}")
        if self.backlog not in ("average", "sum"):
            raise UserInputError(f"backlog must be average or sum, got {self.backlog!r}")
        if not 1 <= self.k <= 4096:
            raise UserInputError(f"k must be in 1..4096 (values kept per 4096), got {self.k}")
        if not 0 <= self.beta < 1 or not 0 <= self.momentum < 1:
            raise UserInputError("beta and momentum must be in [0, 1)")
        if not (self.alpha > 0 and self.outer_lr > 0):
            raise UserInputError("alpha and outer_lr must be positive")
        if self.small_tensors not in SMALL_TENSOR_RULES:
            raise UserInputError(f"small_tensors must be one of {SMALL_TENSOR_RULES}, got {self.small_tensors!r}")
        if self.aggregation not in ("mean", "selectors"):
            raise UserInputError(f"aggregation must be mean or selectors, got {self.aggregation!r}")
        if self.wire_dtype not in ("fp32", "bf16"):
            raise UserInputError(f"wire dtype must be fp32 or bf16, got {self.wire_dtype!r}")
        if self.ef_dtype not in STATE_DTYPES:
            raise UserInputError(f"error-feedback dtype must be one of {', '.join(STATE_DTYPES)}, got {self.ef_dtype!r}")


@dataclass
class Contribution:
    """One replica's message for one round and shard: its pseudo-gradient and the tokens behind it."""

    sender: str
    tokens: int
    tensors: dict[str, SparseTensor] | dict[str, torch.Tensor]


@dataclass(frozen=True)
class SparseStep:
    """One parameter's outer step where it is zero but at some positions: the new value at the flat ``positions``
    (sorted, unique) is the old one minus ``alpha`` times ``delta`` there, and elsewhere the old one, bit for bit."""

    positions: torch.Tensor
    delta: torch.Tensor
    alpha: float

    def new_values(self, old: torch.Tensor) -> torch.Tensor:
        """The new float32 values at :attr:`positions`, given the old ones there."""
        return old - self.alpha * self.delta


def pseudo_gradient(anchor: Tensors, local: Tensors) -> dict[str, torch.Tensor]:
    """Δ = θ(t) − θ_r in float32 on the CPU, where the wire codecs and aggregation run."""
    return {n: anchor[n].detach().float().cpu() - local[n].detach().float().cpu() for n in anchor}


def _weights(contributions: Sequence[Contribution], token_weighted: bool, max_tokens: int = 0) -> list[float]:
    """Each contribution's weight: 1, or (``token_weighted``) its claimed tokens, capped at ``max_tokens`` if set."""
    cap = float(max_tokens) if max_tokens > 0 else math.inf
    w = [min(float(c.tokens), cap) if token_weighted else 1.0 for c in contributions]
    if any(not math.isfinite(x) or x < 0 for x in w) or (w and sum(w) <= 0):
        raise ValueError(f"contribution weights must be finite, non-negative and not all zero: {w}")
    return w


def _clip_values(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contributions' values of one tensor, each clamped to the median contribution's largest magnitude.

    Median-norm clipping bounds a contribution's weight, but under the mean over selectors the weight cancels on
    the coordinates a contribution alone selected: there its raw value is the update. A contribution just under
    the norm bound that concentrates on coordinates of its own would then move the update tens to hundreds of
    times as far as an honest one (``tests/peer/rounds/test_influence.py``). Clamped to the magnitudes most
    contributions have, it moves any coordinate at most as far as an honest contribution's largest value does.
    """
    peaks = torch.stack([v.abs().max() if v.numel() else torch.zeros((), dtype=torch.float32) for v in values])
    cap = float(peaks.median())
    return [v.clamp(-cap, cap) for v in values]


def move_mass(e: torch.Tensor, sent: SparseTensor, phases: int, sign: float) -> torch.Tensor:
    """``e + sign * mass`` in place, where mass is what a contribution of ``phases`` backlogged phases took out of
    the error-feedback buffer: its values times the phases (the positions it sent gave up every phase's mass for
    one phase's step). Only the sent positions change: bit for bit ``e ± decompress(sent) * phases`` but for the
    sign of an unsent zero (a dense add makes -0 + 0 a +0), without a dense parameter-sized buffer. Returns ``e``."""
    if sent.nnz:
        flat = e.view(-1)
        pos = sent.flat_indices()
        mass = sent.dense_values() * phases if phases > 1 else sent.dense_values()
        at = flat[pos].float()  # in float32, then rounded to e's dtype, as a dense in-place add does
        flat[pos] = at.add_(mass, alpha=sign).to(flat.dtype)
    return e


class OuterOptimizer(ABC):
    """The interface the round protocol calls; see the module docstring."""

    config: OuterConfig

    @abstractmethod
    def contribute(self, anchor: Tensors, local: Tensors, sender: str = "", tokens: int = 0) -> Contribution:
        """This replica's contribution for the round (updates internal state such as the EF buffer)."""

    @abstractmethod
    def applying(self, anchor: Tensors, contributions: Sequence[Contribution]) -> Iterator[tuple[str, torch.Tensor]]:
        """The next global parameters (float32, CPU) from the accepted contributions, in the given order, one
        parameter at a time as they are made (``anchor[name]`` is read when that parameter's turn comes, so the
        caller may replace each one as it is yielded)."""

    def apply(self, anchor: Tensors, contributions: Sequence[Contribution]) -> dict[str, torch.Tensor]:
        """Next global parameters (float32, CPU) from the accepted contributions, in the given order."""
        return dict(self.applying(anchor, contributions))

    def sparse_steps(self, names: Sequence[str], contributions: Sequence[Contribution]
                     ) -> Iterator[tuple[str, SparseStep]] | None:
        """:meth:`applying` as one :class:`SparseStep` per name, where this optimizer's step is sparse (then the
        caller changes each parameter at a few positions instead of replacing it); None where it is dense."""
        return None

    def sparse_step(self, contributions: Sequence[Contribution], name: str,
                    weights: Sequence[float] | None = None) -> SparseStep | None:
        """:meth:`applied`'s change to parameter ``name`` as a :class:`SparseStep`, where this optimizer's step is
        sparse (a view then knows the result at a few positions without making the parameter); None where it is
        dense. ``weights``: :meth:`weights` as the caller decided them over the names it applies (without them,
        over this name alone)."""
        return None

    def withdraw(self, contribution: Contribution) -> None:
        """The round closed without ``contribution``; by default nothing is kept."""

    def forget_phase(self, contribution: Contribution, start: Tensors, local: Tensors) -> None:
        """Take back everything of the phase that made ``contribution`` (refused, not withdrawn): it was computed
        from a liar's frames and must not come back in a later one. ``start``/``local``: the parameters the
        phase started from and ended at (its pseudo-gradient). By default nothing is carried between rounds."""

    @abstractmethod
    def state_tensors(self) -> Mapping[str, torch.Tensor]:
        """Optimizer state for checkpoints, keyed ``<kind>.<param name>``."""

    @abstractmethod
    def load_state(self, tensors: Tensors) -> None:
        """Restore :meth:`state_tensors`; missing entries start from zero."""


class SparseLoCo(OuterOptimizer):
    """SparseLoCo: chunked top-k of an error-feedback buffer, 2-bit values, plain outer SGD (docs/algorithms.md §1)."""

    def __init__(self, config: OuterConfig) -> None:
        config.validate()
        self.config = config
        # error-feedback buffer per parameter, on CPU in config.ef_dtype; each read of a spilled one is a fresh
        # tensor, so every change is written back
        self.ef: MutableMapping[str, torch.Tensor] = SpilledTensors(config.ef_dir) if config.ef_dir else {}
        self._store = STATE_DTYPES[config.ef_dtype]
        self.phases = 0  # inner phases in the buffer since our last contribution that was taken
        # the last contribution, the phases it carried, and whether the buffer held anything before it
        self._taken: tuple[int, Contribution, bool] | None = None

    def contribute(self, anchor: Tensors, local: Tensors, sender: str = "", tokens: int = 0) -> Contribution:
        self.phases += 1
        m = self.phases if self.config.backlog == "average" else 1
        held = bool(self.ef)
        sent: dict[str, SparseTensor] = {}
        for name in anchor:  # one tensor at a time: the transient buffers are one parameter's, not the model's
            e = anchor[name].detach().float().cpu() - local[name].detach().float().cpu()  # the phase's delta
            if name in self.ef:
                self._add_kept(name, e)
            k = tensor_k(tuple(e.shape), self.config.k, self.config.small_tensors)
            s = compress(e / m if m > 1 else e, k, self.config.quant_bits)
            # whatever was not sent (including quantisation error) stays for later rounds; after a backlog of m
            # phases, the positions sent give up all m phases' mass for one phase's step
            self.ef[name] = move_mass(e, s, m, -1.0).to(self._store)
            del e
            sent[name] = s
        c = Contribution(sender, tokens, sent)
        self._taken, self.phases = (m, c, held), 0
        return c

    def _add_kept(self, name: str, e: torch.Tensor) -> None:
        """Add β times the buffer kept for ``name`` into the phase's delta ``e`` (float32, in place), a block of the
        kept buffer at a time where it lives in a file: bit for bit ``β·buffer + Δ`` (a float addition does not
        depend on the order of its two terms), without the buffer whole, widened to float32, beside the delta (the
        largest parameter's copies were a contribution's peak: 40 MiB for the small model's embedding)."""
        streamed = stream_of(self.ef, name)
        if streamed.shape != tuple(e.shape):
            raise ValueError(f"the error feedback of {name} has shape {streamed.shape}, the parameter {tuple(e.shape)}")
        flat, at = e.view(-1), 0
        for block in streamed.blocks:  # flat, in order
            n = block.numel()
            # a float32 buffer kept in memory is the stored tensor itself: scaled into a new one, never in place
            scaled = block.float().mul_(self.config.beta) if block.dtype != torch.float32 else block * self.config.beta
            flat[at:at + n].add_(scaled)
            at += n

    def withdraw(self, contribution: Contribution) -> None:
        # A straggler's unsent pseudo-gradient goes back into its buffer, as if it had never been taken out.
        m = self._taken[0] if self._taken is not None and self._taken[1] is contribution else 1
        for name, s in contribution.tensors.items():
            self.ef[name] = move_mass(self.ef[name], s, m, 1.0)
        self.phases = m if self.config.backlog == "average" else self.phases

    def forget_phase(self, contribution: Contribution, start: Tensors, local: Tensors) -> None:
        # The buffer is β·(what earlier phases left) + Δ − m·sent: adding the sent values back and taking the
        # phase's Δ out leaves the earlier phases' part, clean, up to the buffer's storage rounding. A buffer that
        # held nothing before the phase is emptied exactly.
        m, _c, held = self._taken if self._taken is not None and self._taken[1] is contribution else (1, None, True)
        if not held:
            self.ef.clear()
        else:
            for name, s in contribution.tensors.items():
                delta = start[name].detach().float().cpu() - local[name].detach().float().cpu()
                e = move_mass(self.ef[name].float(), s, m, 1.0).sub_(delta)
                self.ef[name] = e.to(self._store)
        self.phases = m - 1 if self.config.backlog == "average" else self.phases
        self._taken = None

    def aggregate(self, contributions: Sequence[Contribution], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The combined pseudo-gradient Δ per parameter (zero where no contribution selected anything)."""
        return dict(self.aggregated(contributions, names))

    def _values(self, contributions: Sequence[Contribution], name: str) -> list[torch.Tensor]:
        """The contributions' values of one tensor, clamped to the median's largest magnitude under clipping."""
        values = [c.tensors[name].dense_values() for c in contributions]
        return _clip_values(values) if self.config.clip_median and len(contributions) > 1 else values

    def weights(self, contributions: Sequence[Contribution], names: Sequence[str]) -> list[float]:
        """Each contribution's weight in the round over ``names``: equal or by tokens, and under median clipping
        scaled down to the median contribution norm, which is taken over every name (from the sparse values)."""
        cfg = self.config
        w = _weights(contributions, cfg.token_weighted, cfg.max_tokens)
        if cfg.clip_median and len(contributions) > 1:
            values = {name: self._values(contributions, name) for name in names}
            norms = [math.sqrt(sum(float(values[name][i].double().pow(2).sum()) for name in names))
                     for i in range(len(contributions))]
            median = float(torch.tensor(norms, dtype=torch.float64).median())
            w = [wi * (min(1.0, median / n) if n > 0 else 1.0) for wi, n in zip(w, norms)]
        return w

    def aggregated(self, contributions: Sequence[Contribution], names: Sequence[str],
                   weights: Sequence[float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`aggregate` one parameter at a time: the weights (and median clipping) are decided over every
        name first (:meth:`weights`; given: decided before over the shard), then each dense Δ is made when it is
        asked for, so the caller holds one parameter's Δ at a time, not the model's (docs/design.md, "Memory")."""
        for name, (positions, values) in self._sparse_aggregated(contributions, names, weights):
            shape = contributions[0].tensors[name].shape
            delta = torch.zeros(math.prod(shape), dtype=torch.float32)
            delta[positions] = values
            yield name, delta.view(shape)

    def _sparse_aggregated(self, contributions: Sequence[Contribution], names: Sequence[str],
                           weights: Sequence[float] | None = None
                           ) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per name, the aggregate Δ at the flat positions some contribution selected (sorted), and nowhere else
        (it is zero there): the sums run over those positions only, contribution after contribution in the given
        order, so each value is bit for bit what a dense sum gives, with temporaries as large as the positions
        sent rather than the parameter (several parameter-sized buffers each round, before)."""
        cfg = self.config
        w = list(weights) if weights is not None else self.weights(contributions, names)
        total = sum(_weights(contributions, cfg.token_weighted, cfg.max_tokens))
        for name in names:
            picked = [c.tensors[name].flat_indices() for c in contributions]
            positions, where = torch.unique(torch.cat(picked), sorted=True, return_inverse=True)
            num = torch.zeros(positions.numel(), dtype=torch.float32)
            den = torch.zeros(positions.numel(), dtype=torch.float32)
            start = 0
            for wi, idx, v in zip(w, picked, self._values(contributions, name)):
                at = where[start:start + idx.numel()]
                start += idx.numel()
                num.index_add_(0, at, v * wi)
                if cfg.aggregation == "selectors":
                    den.index_add_(0, at, torch.full((idx.numel(),), wi, dtype=torch.float32))
            if cfg.aggregation == "mean":
                delta = num / total
            else:
                delta = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))
            yield name, (positions, delta)

    def _stepped(self, t: torch.Tensor, positions: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``t - alpha * Δ`` for a Δ that is zero but at ``positions``: a copy of ``t`` changed there (elsewhere
        ``x - alpha * 0`` is ``x`` bit for bit)."""
        out = t.detach().float().cpu().clone(memory_format=torch.contiguous_format)
        flat = out.view(-1)
        flat[positions] = SparseStep(positions, delta, self.config.alpha).new_values(flat[positions])
        return out

    def sparse_steps(self, names: Sequence[str], contributions: Sequence[Contribution]
                     ) -> Iterator[tuple[str, SparseStep]] | None:
        if not contributions:
            return None
        return ((n, SparseStep(positions, delta, self.config.alpha))
                for n, (positions, delta) in self._sparse_aggregated(contributions, list(names)))

    def sparse_step(self, contributions: Sequence[Contribution], name: str,
                    weights: Sequence[float] | None = None) -> SparseStep | None:
        if not contributions:
            return None
        w = weights if weights is not None else self.weights(contributions, [name])
        for _, (positions, delta) in self._sparse_aggregated(contributions, [name], weights=w):
            return SparseStep(positions, delta, self.config.alpha)
        raise KeyError(name)

    def applying(self, anchor: Tensors, contributions: Sequence[Contribution]) -> Iterator[tuple[str, torch.Tensor]]:
        if not contributions:
            for n in anchor:
                yield n, anchor[n].detach().float().cpu().clone()
            return
        for n, (positions, delta) in self._sparse_aggregated(contributions, list(anchor)):
            yield n, self._stepped(anchor[n], positions, delta)

    def applied(self, anchor: Tensors, contributions: Sequence[Contribution], name: str,
                weights: Sequence[float] | None = None) -> torch.Tensor:
        """One parameter of :meth:`apply`'s result, bit for bit, for a view that makes the result one parameter at
        a time (``hlbp.peer.rounds.overlap.Previewed``). ``weights``: :meth:`weights` over ``anchor``'s names,
        decided once by the caller; without them they are decided here, over every name, for this one read."""
        t = anchor[name]
        if not contributions:
            return t.detach().float().cpu().clone()
        w = weights if weights is not None else self.weights(contributions, list(anchor))
        step = self.sparse_step(contributions, name, w)
        assert step is not None  # contributions were given
        return self._stepped(t, step.positions, step.delta)

    def state_tensors(self) -> Mapping[str, torch.Tensor]:
        """The buffer as ``ef.<name>``, each read when asked for (a spilled buffer is not read whole)."""
        return Prefixed(self.ef, "ef.")

    def load_state(self, tensors: Tensors) -> None:
        self.ef.clear()
        for n in [n for n in tensors if n.startswith("ef.")]:
            self.ef[n[3:]] = tensors[n].to(self._store, copy=True)


class DiLoCo(OuterOptimizer):
    """DiLoCo: dense mean pseudo-gradient, Nesterov outer SGD; the dense baseline SparseLoCo must beat."""

    def __init__(self, config: OuterConfig) -> None:
        config.validate()
        self.config = config
        self.momentum: dict[str, torch.Tensor] = {}

    def contribute(self, anchor: Tensors, local: Tensors, sender: str = "", tokens: int = 0) -> Contribution:
        dtype = torch.bfloat16 if self.config.wire_dtype == "bf16" else torch.float32
        return Contribution(sender, tokens, {n: d.to(dtype) for n, d in pseudo_gradient(anchor, local).items()})

    def applying(self, anchor: Tensors, contributions: Sequence[Contribution]) -> Iterator[tuple[str, torch.Tensor]]:
        if not contributions:
            for n in anchor:
                yield n, anchor[n].detach().float().cpu().clone()
            return
        w = _weights(contributions, self.config.token_weighted, self.config.max_tokens)
        total = sum(w)
        mu, lr = self.config.momentum, self.config.outer_lr
        for name in anchor:
            a = anchor[name]
            mean = torch.zeros(a.shape, dtype=torch.float32)
            for wi, c in zip(w, contributions):
                mean.add_(c.tensors[name].float(), alpha=wi / total)
            m = self.momentum.get(name)
            m = mean.clone() if m is None else m.mul_(mu).add_(mean)
            self.momentum[name] = m
            yield name, a.detach().float().cpu() - lr * (mean + mu * m)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"momentum.{n}": t for n, t in self.momentum.items()}

    def load_state(self, tensors: Tensors) -> None:
        self.momentum = {n[9:]: t.float().clone() for n, t in tensors.items() if n.startswith("momentum.")}


def make_outer(config: OuterConfig) -> OuterOptimizer:
    """The outer optimizer the config names."""
    config.validate()
    return SparseLoCo(config) if config.kind == "sparseloco" else DiLoCo(config)
