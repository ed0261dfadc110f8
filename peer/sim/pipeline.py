"""A pipeline replica in one process as a simulation ``Replica``: the in-process pipeline model of
:mod:`hlbp.peer.model.pipeline` with its own AdamW state and data, so that it takes part in
:func:`hlbp.peer.sim.engine.run_outer_simulation` beside full replicas.
"""

from __future__ import annotations

import torch

from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import ModelConfig
from hlbp.peer.model.pipeline import PipelineModel, build_pipeline
from hlbp.peer.model.subspace import SubspaceCodec, SubspaceConstraint, anchor_table
from hlbp.peer.train.trainer import BatchFn, InnerTrainer, OptimConfig


class PipelineReplica:
    """A pipeline (or, with one stage, a full) replica with its own AdamW state and data: a simulation ``Replica``.

    It re-projects variant A's constrained tensors after every inner step and, after loading the global
    parameters of an outer step, remembers them and rebuilds T_fixed at every boundary.
    """

    def __init__(self, name: str, model: PipelineModel, trainer: InnerTrainer, codec: CodecConfig) -> None:
        self.name, self.model, self.trainer, self.codec = name, model, trainer, codec
        config = model.stages[0].config
        params = model.shard_parameters()
        self.constraint = SubspaceConstraint(params, config) if config.subspace_rank else None
        self.refresh_tables()

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.shard_parameters().items()}

    @torch.no_grad()
    def load_params(self, params: dict[str, torch.Tensor]) -> None:
        for n, p in self.model.shard_parameters().items():
            p.copy_(params[n])
        if self.constraint is not None:
            self.constraint.sync()
        self.refresh_tables()

    def train(self, steps: int) -> float:
        total = 0.0
        for _ in range(steps):
            total += self.trainer.train_step()
            if self.constraint is not None:
                self.constraint.reproject()
        return total / max(1, steps)

    @torch.no_grad()
    def refresh_tables(self) -> None:
        """Every boundary's T_fixed from the synchronized embedding (B and A+drift), shared by all boundaries."""
        subspace = [c for c in self.model.codecs if isinstance(c, SubspaceCodec)]
        if not subspace or subspace[0].variant == "subspace-a":
            return
        first = subspace[0]
        base = getattr(self.model.stages[0], "fixed_table", None)
        table = anchor_table(first.variant, base, self.model.stages[0].embed.weight.detach(), first.basis)
        for codec in subspace:
            codec.set_table(table)

    def meters(self) -> list[dict[str, float]]:
        return self.model.meters()


def make_replica(
    name: str,
    config: ModelConfig,
    codec: CodecConfig,
    n_stages: int,
    full_state: dict[str, torch.Tensor],
    optim: OptimConfig,
    batch_fn: BatchFn,
    device: torch.device,
    bounds: list[tuple[int, int]] | None = None,
) -> PipelineReplica:
    """A replica of the run's model ``config`` starting from ``full_state``: a pipeline of ``n_stages`` stages
    with ``codec`` at each boundary, or a full replica when ``n_stages`` is 1."""
    model = build_pipeline(config, codec, n_stages, full_state, bounds).to(device)
    return PipelineReplica(name, model, InnerTrainer(model, optim, batch_fn, device), codec)
