"""A pipeline replica in one process: the stages of one swarm chained with an activation codec at every boundary.

Each boundary is a codec module (:mod:`hlbp.peer.model.subspace`) whose forward and backward go through the real wire
bytes of :mod:`hlbp.protocol.activations`, so the loss reflects exactly what stage peers would compute and each
boundary's meter counts the bytes that would cross it in each direction. :class:`hlbp.peer.sim.pipeline.PipelineReplica`
trains one with its own AdamW state, so it takes part in :func:`hlbp.peer.sim.engine.run_outer_simulation` beside
full replicas. A one-stage pipeline has no boundary and is a full replica; variant-A runs use it for their full
replicas because those must keep the same constraint (see :func:`run_model_config`). In a network run the full
replicas (hlbp.peer.node.replica) build the same model with :func:`initial_model`, so every replica of a run starts
from the same weights bit for bit, constrained or not.

Keeping T_fixed in step across peers: after each outer step every stage needs the anchor table of
:func:`hlbp.peer.model.subspace.anchor_table`. For A it is fixed by the seed. For B and A+drift it is a function of the
synchronized embedding: here that is simply the replica's own stage-0 embedding after ``load_params``; in a network
run stage 0 holds it and every other stage peer follows the embedding's shard of each round (it applies the same
accepted contributions to a copy of it, hlbp.peer.rounds.follow), and each rebuilds its codec's table from it with
:meth:`hlbp.peer.model.codec.ActivationCodec.rebuild_table` before the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hlbp.peer.model.codec import ActivationCodec, CodecConfig
from hlbp.peer.model.decoder import (
    ModelConfig,
    Stage,
    build_model,
    load_from_full,
    partition,
    seed_parameters,
    seeded_parameter,
    split,
)
from hlbp.peer.model.subspace import constrained_model_config, make_codec


def run_model_config(
    base: ModelConfig, codec: CodecConfig, n_stages: int, bounds: list[tuple[int, int]] | None = None
) -> ModelConfig:
    """The model every replica of a run trains, full replicas included.

    For the variants A it is the constrained network, constrained up to the first layer of the last stage of the
    run's partition. Full replicas train it too: the global model is one function, so a constraint that pipeline
    replicas need for a lossless codec binds every replica (docs/algorithms.md §3 A; the outer step is then projected
    identically everywhere). Only the codec, and so the bytes, differ between full and pipeline replicas.
    """
    bounds = bounds if bounds is not None else partition(base.n_layers, n_stages)
    return constrained_model_config(base, codec, bounds[-1][0])


class PipelineModel(nn.Module):
    """Stages chained through codecs; ``forward(ids)`` gives logits and ``loss`` is the last stage's.

    Parameter names inside the module are ``stages.<s>.<name>``; :meth:`shard_parameters` gives them under the
    whole model's names.
    """

    def __init__(self, stages: Sequence[Stage], codecs: Sequence[ActivationCodec]) -> None:
        super().__init__()
        if len(codecs) != len(stages) - 1:
            raise ValueError(f"{len(stages)} stages need {len(stages) - 1} codecs, got {len(codecs)}")
        self.stages = nn.ModuleList(stages)
        self.codecs = nn.ModuleList(codecs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.stages[0](ids)
        for codec, stage in zip(self.codecs, self.stages[1:]):
            h = stage(codec(h, ids))
        return h

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].loss(logits, targets)

    def loss_of(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``loss(forward(ids), targets)`` with the last stage's logits neither held nor made whole
        (:meth:`Stage.loss_of`): what a training step calls."""
        h = ids
        for codec, stage in zip(self.codecs, self.stages[:-1]):
            h = codec(stage(h), ids)
        return self.stages[-1].loss_of(h, targets)

    def boundary_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states leaving each stage but the last, with no codec in between (for measurements)."""
        out, h = [], self.stages[0](ids)
        for stage in self.stages[1:]:
            out.append(h)
            h = stage(h)
        return out

    def shard_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for stage in self.stages for n, p in stage.named_parameters()}

    def meters(self) -> list[dict[str, float]]:
        """Per boundary: bytes per token and totals each way so far."""
        return [codec.meter.summary() for codec in self.codecs]


def build_pipeline(
    config: ModelConfig,
    codec: CodecConfig,
    n_stages: int,
    full_state: dict[str, torch.Tensor] | None = None,
    bounds: list[tuple[int, int]] | None = None,
    max_tokens: int = 1 << 20,
) -> PipelineModel:
    """Stages of ``config`` (the run's model, see :func:`run_model_config`), loaded from ``full_state`` if given."""
    stages = split(config, n_stages, bounds)
    if full_state is not None:
        for stage in stages:
            load_from_full(stage, full_state)
    embed = stages[0].embed.weight.detach()
    base = getattr(stages[0], "fixed_table", None)
    codecs = [
        make_codec(codec, config.d_model, config.vocab_size, config.max_seq_len, base, embed, max_tokens)
        for _ in range(n_stages - 1)
    ]
    return PipelineModel(stages, codecs)


def initial_model(config: ModelConfig, seed: int) -> Stage:
    """The whole model ``config`` with the run's initial parameters from ``seed``: what a full replica trains.

    Each parameter comes from a generator keyed by the seed and its name
    (:func:`hlbp.peer.model.decoder.seeded_parameter`), so a stage built alone (:func:`initial_stage`) holds
    exactly its slice. The subspace fields of ``config`` do not change the parameters (U and T_fixed come from
    their own seeded generators), so a run's constrained and plain models start from the same weights.
    """
    torch.manual_seed(seed)
    model = build_model(config)
    seed_parameters(model, seed)
    return model


def initial_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial parameters from ``seed``, as every replica of a run starts: exactly
    :func:`initial_model`'s."""
    return {n: t.detach().clone() for n, t in initial_model(config, seed).state_dict().items()}


def initial_stage(config: ModelConfig, seed: int, start: int, end: int) -> Stage:
    """Layers ``[start, end)`` with the run's initial parameters, bit for bit the whole model's slice, without
    building the other layers (a stage peer of a large model holds only its own)."""
    stage = Stage(config, start, end)
    seed_parameters(stage, seed)
    return stage


def initial_tensors(config: ModelConfig, seed: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Some of the run's initial parameters by name (the shapes are read from a model on the meta device, which
    holds no memory)."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in build_model(config).named_parameters()}
    return {n: seeded_parameter(config, n, shapes[n], seed) for n in names}
