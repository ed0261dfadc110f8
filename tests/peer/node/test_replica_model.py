"""A full replica's model in a network run (hlbp.peer.node.replica.replica_model): the run's model, bit for bit
the initial weights stage peers load, and in a variant-A run the constrained network whose pseudo-gradient stays
in span(U) where the constraint applies.
"""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.model.basis import off_span, project_writer, subspace_basis
from hlbp.peer.model.decoder import load_from_full, preset, split
from hlbp.peer.model.pipeline import initial_state, run_model_config
from hlbp.peer.model.subspace import constrained_names
from hlbp.peer.node.replica import codec_config, replica_model
from hlbp.peer.rounds.outer import pseudo_gradient
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig
from hlbp.protocol.manifest import CodecSpec, Manifest

VOCAB = 300
SEED = 11
STAGES = ((0, 2), (2, 4))
CPU = torch.device("cpu")


def _manifest(codec: str, k: int = 0) -> Manifest:
    return Manifest(run_id="replica-model", seed=SEED, model="tiny", tokenizer_hash="0" * 64, stages=STAGES,
                    model_overrides={"d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 32},
                    codec=CodecSpec(name=codec, k=k))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize(("codec", "k"), [("dense", 0), ("subspace-b", 8)])
def test_dense_and_b_runs_train_the_plain_model_from_the_runs_initial_weights(codec: str, k: int) -> None:
    m = _manifest(codec, k)
    config, model, constraint = replica_model(m, VOCAB)
    plain = preset(m.model, **m.model_overrides, vocab_size=VOCAB)
    assert config == plain and constraint is None
    start = initial_state(plain, SEED)
    assert all(torch.equal(t, start[n]) for n, t in _weights(model).items())


@pytest.mark.parametrize("codec", ["subspace-a", "subspace-a-drift"])
def test_a_runs_train_the_stage_peers_constrained_model_from_the_same_weights(codec: str) -> None:
    m = _manifest(codec, 8)
    config, model, constraint = replica_model(m, VOCAB)
    base = preset(m.model, **m.model_overrides, vocab_size=VOCAB)
    # exactly the model stage peers build (hlbp.peer.node.stage._build), constrained before the last stage
    assert config == run_model_config(base, codec_config(m), len(STAGES), [tuple(s) for s in STAGES])
    assert config.subspace_rank == 8 and config.constrained_layers == STAGES[-1][0]
    assert config.subspace_drift == (codec == "subspace-a-drift")
    assert constraint is not None and set(constraint.targets) == set(constrained_names(config))
    full = initial_state(config, SEED)
    weights = _weights(model)
    assert weights.keys() == full.keys() and all(torch.equal(weights[n], full[n]) for n in full)
    for stage in split(config, len(STAGES), [tuple(s) for s in STAGES]):  # each stage peer's slice, bit for bit
        load_from_full(stage, full)
        assert all(torch.equal(t, weights[n]) for n, t in stage.state_dict().items())
    # the constraint does not change the initial weights: a plain run starts from the same bits
    plain = initial_state(base, SEED)
    assert all(torch.equal(weights[n], plain[n]) for n in plain)


def test_an_a_replicas_pseudo_gradient_stays_in_span_u_where_the_constraint_applies() -> None:
    config, model, constraint = replica_model(_manifest("subspace-a", 8), VOCAB)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 17), generator=g) for _ in range(6)]
    trainer = InnerTrainer(model, OptimConfig(lr=1e-2, warmup_steps=0, total_steps=10), lambda step, micro: (
        batches[step][:, :-1], batches[step][:, 1:]), CPU, constraint=constraint)
    basis = subspace_basis(config.d_model, config.subspace_rank, config.subspace_seed)
    names = constrained_names(config)

    def off(delta: dict[str, torch.Tensor], name: str) -> float:
        d = delta[name]
        rest = off_span(d, basis) if names.get(name) == "rows" else d - project_writer(d, basis)
        return float(rest.norm() / d.norm())

    # the anchor a round loads is off span(U) in general (a sparse outer step is): the constraint works from it
    anchor = {n: p.detach().clone() + 0.01 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    trainer.load_params(anchor)
    for _ in range(3):
        trainer.train_step()
    delta = pseudo_gradient(anchor, dict(model.named_parameters()))
    for name in names:
        assert delta[name].norm() > 0, name
        assert off(delta, name) < 1e-5, (name, off(delta, name))
    # a parameter outside the constraint (a query projection, the last stage's writers) moves freely
    free = ["blocks.0.attn.wq.weight", f"blocks.{config.n_layers - 1}.ffn.w2.weight"]
    assert all(off(delta, n) > 0.5 for n in free), [off(delta, n) for n in free]
    # a resumed trainer projects from its restored weights too
    tensors, header = trainer.state_tensors()
    resumed = InnerTrainer(replica_model(_manifest("subspace-a", 8), VOCAB)[1], trainer.cfg, trainer.batch_fn, CPU,
                           constraint=None)
    resumed.load_state(tensors, header)  # (no constraint: load_state must not need one)
    trainer.load_state(tensors, header)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train_step()
    delta = pseudo_gradient(start, dict(model.named_parameters()))
    assert all(off(delta, name) < 1e-5 for name in names)
