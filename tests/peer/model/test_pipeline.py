"""The in-process pipeline: exact where it must be, bytes counted per boundary, and consistent under SparseLoCo."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hlbp.peer.bench.heterogeneous import HeterogeneousBenchConfig, cells, half_vs_all
from hlbp.peer.data.streams import TokenStream, val_batches
from hlbp.peer.model.basis import fixed_table, off_span, project_writer, subspace_basis
from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.decoder import ModelConfig, build_model
from hlbp.peer.model.pipeline import build_pipeline, initial_state, run_model_config
from hlbp.peer.model.subspace import constrained_names, drift_table
from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo
from hlbp.peer.sim.engine import EngineConfig, FullReplica, run_outer_simulation
from hlbp.peer.sim.pipeline import make_replica
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, evaluate, micro_batches
from hlbp.protocol.activations import frame_size

CPU = torch.device("cpu")


def _config(vocab_size: int = 64) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=16)


def _loss_and_grads(model, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(model(x), y)
    loss.backward()
    params = model.shard_parameters() if hasattr(model, "shard_parameters") else dict(model.named_parameters())
    return float(loss.detach()), {n: p.grad.clone() for n, p in params.items()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[n] - b[n]).double().pow(2).sum()) for n in b)
    return (num / sum(float(t.double().pow(2).sum()) for t in b.values())) ** 0.5


@pytest.mark.parametrize(("kind", "wire"), [("dense", "fp64"), ("subspace-a", "fp32"), ("subspace-a-drift", "fp32")])
def test_pipeline_computes_the_whole_model_exactly(kind, wire):
    """Dense over fp64 is the identity; variant A is lossless: same loss and the same gradient of every parameter."""
    codec = CodecConfig(kind, "1/8", wire_dtype=wire)
    config = run_model_config(_config(), codec, 4)
    state = initial_state(config, 0)
    whole = build_model(config)
    whole.load_state_dict(state)
    pipe = build_pipeline(config, codec, 4, state)
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    want_loss, want = _loss_and_grads(whole, x, y)
    got_loss, got = _loss_and_grads(pipe, x, y)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert _rel(got, want) < 1e-5
    for meter in pipe.meters():  # three boundaries, one frame each way, sizes straight from the wire format
        k, ids = (32, 0) if kind == "dense" else (4, 2)
        assert meter["forward_bytes"] == frame_size(2, 12, k, wire, ids)
        assert meter["backward_bytes"] == frame_size(2, 12, k, wire, 0)
        assert meter["forward_frames"] == meter["backward_frames"] == 1


def test_variant_b_is_lossy_and_rebuilds_its_table_from_the_synchronized_embedding():
    codec = CodecConfig("subspace-b", "1/8")
    config = run_model_config(_config(), codec, 2)
    assert config == _config()  # no constraint in B
    state = initial_state(config, 0)
    replica = make_replica("b", config, codec, 2, state, OptimConfig(warmup_steps=1, total_steps=4),
                           lambda step, micro: (torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))), CPU)
    table = replica.model.codecs[0].table
    assert torch.equal(table, state["embed.weight"])
    replica.train(2)
    assert torch.equal(replica.model.codecs[0].table, table)  # fixed during the round
    new = {n: t + 0.01 for n, t in replica.params().items()}
    replica.load_params(new)
    assert torch.equal(replica.model.codecs[0].table, new["embed.weight"])


def test_one_stage_pipeline_replica_is_a_full_replica():
    config = _config()
    optim = OptimConfig(warmup_steps=1, total_steps=5)

    def batch_fn(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 64, (2, 12), generator=g), torch.randint(0, 64, (2, 12), generator=g)

    state = initial_state(config, 0)
    ours = make_replica("p", config, CodecConfig(), 1, state, optim, batch_fn, CPU)
    model = build_model(config)
    model.load_state_dict(state)
    theirs = FullReplica("f", model, InnerTrainer(model, optim, batch_fn, CPU))
    assert ours.train(3) == theirs.train(3)
    assert all(torch.equal(ours.params()[n], p) for n, p in theirs.params().items())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["subspace-a", "subspace-a-drift"])
def test_variant_a_invariant_holds_after_inner_steps_and_sparseloco_rounds(builtin_data, variant):
    """Mixed run (one 3-stage pipeline, one full replica): at every boundary (h − T[x])(I − UUᵀ) ≈ 0 after inner
    steps and after outer steps, the pipeline scores exactly what the global model scores, and pseudo-gradients
    of constrained tensors carry nothing outside span(U)."""
    codec = CodecConfig(variant, "1/8")
    base = _config(builtin_data.vocab_size)
    config = run_model_config(base, codec, 3)
    assert config.constrained_layers == 3  # stages [0, 2), [2, 3), [3, 4): the last one may stay free
    state = initial_state(base, 0)
    optim = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=4)
    replicas = [
        make_replica(f"replica-{r}", config, codec, n_stages, state, optim,
                     micro_batches(TokenStream(builtin_data.train, 16, 2, seed=0, rank=r), 1), CPU)
        for r, n_stages in enumerate((1, 3))
    ]
    pipe = replicas[1]
    val = val_batches(builtin_data.val, 16, 2, 2)
    x = val[0][0]
    u = subspace_basis(base.d_model, 4, 0)

    def assert_invariant() -> None:
        with torch.no_grad():
            for codec_module, h in zip(pipe.model.codecs, pipe.model.boundary_states(x)):
                resid = h - codec_module.table[x]
                assert float(off_span(resid, u).norm() / resid.norm()) < 1e-5

    assert_invariant()
    pipe.train(2)
    assert_invariant()
    sim = EngineConfig(model=config, outer=OuterConfig(kind="sparseloco", k=64), optim=optim, replicas=2, rounds=2,
                    inner_steps=2, batch_size=2, seq_len=16, eval_batches=2)
    result = run_outer_simulation(sim, builtin_data, replicas, CPU)
    assert_invariant()
    # the global model the simulation evaluated, run through the compressed pipeline, scores the same
    assert evaluate(pipe.model, val, CPU) == pytest.approx(result["final_val_loss"], rel=1e-5)
    # the sparse outer step left span(U) in the stored writers, yet the model's writes stay in it (projected)
    w = pipe.params()["blocks.0.attn.wo.weight"]
    assert float((w - project_writer(w, u)).norm()) > 1e-3
    if variant == "subspace-a-drift":
        want = drift_table(fixed_table(base.vocab_size, base.d_model, 0), pipe.params()["embed.weight"], u)
        assert torch.allclose(pipe.model.codecs[0].table, want, atol=1e-6)
    # next round's pseudo-gradient of every constrained tensor lies in span(U)
    anchor = {n: t.clone() for n, t in pipe.params().items()}
    pipe.train(1)
    for name, side in constrained_names(config).items():
        delta = anchor[name] - pipe.params()[name]
        leak = off_span(delta, u) if side == "rows" else delta - project_writer(delta, u)
        assert float(leak.abs().max()) < 1e-5, name


def test_sparse_outer_step_is_projected_identically_by_every_replica():
    """Two replicas load the same (off-span) outer result; their functions agree and stay lossless."""
    codec = CodecConfig("subspace-a", "1/8")
    config = run_model_config(_config(), codec, 2)
    state = initial_state(config, 0)
    optim = OptimConfig(warmup_steps=1, total_steps=4)

    def batch_fn(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))

    a = make_replica("a", config, codec, 2, state, optim, batch_fn, CPU)
    b = make_replica("b", config, codec, 1, state, optim, batch_fn, CPU)
    a.train(2)
    outer = SparseLoCo(OuterConfig(k=64))
    anchor = {n: t.float() for n, t in state.items()}
    new = outer.apply(anchor, [outer.contribute(anchor, a.params(), "a", a.tokens)])
    a.load_params(new)
    b.load_params(new)
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert float(a.model.loss(a.model(x), y)) == pytest.approx(float(b.model.loss(b.model(x), y)), rel=1e-6)


def test_heterogeneous_matrix_shares_the_uncompressed_cell():
    full = cells(HeterogeneousBenchConfig())
    assert len(full) == 1 + 3 * 3 * 2 and full[0].codec is None
    assert {(c.split, c.compressed) for c in full[1:]} == {("half", 2), ("all", 4)}
    quick = cells(dataclasses.replace(HeterogeneousBenchConfig.quick(), replicas=6))
    assert [c.compressed for c in quick] == [0, 3, 6, 3, 6, 3, 6]


def test_half_vs_all_calls_float_rounding_a_tie():
    rows = [{"split": s, "variant": v, "ratio": "1/32", "final_val_loss": loss}
            for s, v, loss in (("half", "subspace-a", 5.0), ("all", "subspace-a", 5.0 + 1e-6),
                               ("half", "subspace-b", 5.0), ("all", "subspace-b", 5.1))]
    assert [r["loses_less"] for r in half_vs_all(rows)] == ["equal", "half"]
