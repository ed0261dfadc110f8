"""The stage split computes exactly what the whole model computes: same loss, same gradients."""

import dataclasses
import itertools

import pytest
import torch

from hlbp.peer.bench.stepcost import held_for_backward
from hlbp.peer.common.errors import UserInputError
from hlbp.peer.model.decoder import (
    PRESETS,
    balanced_partition,
    build_model,
    compute_shares,
    count_parameters,
    head_macs,
    layer_macs,
    load_from_full,
    partition,
    preset,
    split,
)
from hlbp.peer.model.ops import fused_head


def _chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_stages_chained_equal_whole_model_loss_and_gradients(n_stages):
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=300)
    model = build_model(config)
    stages = split(config, n_stages)
    state = model.state_dict()
    for stage in stages:
        load_from_full(stage, state)
    x = torch.randint(0, 300, (2, 32))
    y = torch.randint(0, 300, (2, 32))

    whole = model.loss(model(x), y)
    whole.backward()
    piped = stages[-1].loss(_chain(stages, x), y)
    piped.backward()

    assert torch.allclose(whole, piped, atol=1e-6)
    whole_grads = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.allclose(p.grad, whole_grads[name], atol=1e-6, rtol=1e-5), name
            seen.add(name)
    # the stages together own every parameter exactly once
    assert seen == set(whole_grads)
    assert sum(count_parameters(s) for s in stages) == count_parameters(model)


def test_stage_roles_embedding_first_head_last():
    stages = split(preset("tiny"), 2)
    assert hasattr(stages[0], "embed") and not hasattr(stages[0], "head")
    assert hasattr(stages[1], "head") and not hasattr(stages[1], "embed")


def test_presets_have_documented_sizes():
    sizes = {}
    for name, config in PRESETS.items():
        with torch.device("meta"):
            sizes[name] = count_parameters(build_model(config))
    assert 1e6 <= sizes["tiny"] <= 3e6
    assert 20e6 <= sizes["small"] <= 40e6
    assert sizes["125m"] < sizes["350m"] < sizes["1b"]


def test_partition_is_contiguous_and_even():
    assert partition(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def _stage_macs(config, bounds, seq_len):
    return [(b - a) * layer_macs(config, seq_len) + (head_macs(config) if b == config.n_layers else 0)
            for a, b in bounds]


def _every_split(n_layers, n_stages):
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        edges = (0, *cuts, n_layers)
        yield list(itertools.pairwise(edges))


@pytest.mark.parametrize("name", ["tiny", "small", "125m", "350m", "1b"])
@pytest.mark.parametrize("seq_len", [64, 1024])
def test_the_balanced_partition_has_the_fastest_slowest_stage_of_every_split(name, seq_len):
    config = preset(name)
    for n_stages in range(1, min(config.n_layers, 5) + 1):
        bounds = balanced_partition(config, n_stages, seq_len)
        assert bounds[0][0] == 0 and bounds[-1][1] == config.n_layers and all(a < b for a, b in bounds)
        assert all(x[1] == y[0] for x, y in itertools.pairwise(bounds)) and len(bounds) == n_stages
        best = min(max(_stage_macs(config, b, seq_len)) for b in _every_split(config.n_layers, n_stages))
        assert max(_stage_macs(config, bounds, seq_len)) == best
        assert best <= max(_stage_macs(config, partition(config.n_layers, n_stages), seq_len))


@pytest.mark.parametrize("name", ["tiny", "125m"])
def test_compute_shares_are_each_stages_fraction_of_the_models_multiply_accumulates(name):
    config = preset(name)
    for n_stages in (1, 2, 3):
        bounds = partition(config.n_layers, n_stages)
        shares = compute_shares(config, bounds, 64)
        macs = _stage_macs(config, bounds, 64)
        assert shares == pytest.approx([m / sum(macs) for m in macs]) and sum(shares) == pytest.approx(1.0)
    tiny = compute_shares(preset("tiny"), [(0, 2), (2, 4)], 64)
    assert tiny[1] == pytest.approx(0.7735, abs=1e-4)  # the head: more than the layers' half
    free = dataclasses.replace(preset("small"), vocab_size=1)
    assert compute_shares(free, [(0, 3), (3, 6)], 256)[0] == pytest.approx(0.5, abs=1e-3)


def test_the_head_moves_layers_off_the_last_stage_and_a_free_head_leaves_the_even_split():
    tiny = preset("tiny")  # the head costs about five blocks: the last stage keeps one
    assert balanced_partition(tiny, 2, 64) == [(0, 3), (3, 4)]
    assert balanced_partition(tiny, 3, 64) == partition(4, 3) == [(0, 2), (2, 3), (3, 4)]
    free = dataclasses.replace(preset("small"), vocab_size=1)  # a head of d multiply-accumulates
    for n_stages in range(1, 7):
        assert balanced_partition(free, n_stages, 256) == partition(6, n_stages)


@pytest.mark.parametrize(
    "call",
    [
        lambda: partition(4, 5),
        lambda: balanced_partition(preset("tiny"), 5, 64),
        lambda: partition(4, 0),
        lambda: preset("huge"),
        lambda: preset("tiny", d_model=130),
        lambda: preset("tiny", colour=1),
        lambda: split(preset("tiny"), 2, bounds=[(0, 1), (2, 4)]),
    ],
)
def test_bad_model_arguments_raise_user_input_error(call):
    with pytest.raises(UserInputError):
        call()


@pytest.mark.parametrize("variant", [{}, {"subspace_rank": 16}, {"subspace_rank": 16, "subspace_drift": True}],
                         ids=["plain", "subspace", "drift"])
def test_the_forward_run_part_by_part_on_each_parts_parameters_is_the_forward_bit_for_bit(variant):
    """forward_parts: every stage of a split (first, middle, last, and the whole model), run one step at a time
    with functional_call on that step's parameters alone, gives Stage.forward's output bit for bit, and the steps
    read every parameter exactly once."""
    from hlbp.peer.model.decoder import forward_parts

    torch.manual_seed(0)
    config = preset("tiny", vocab_size=512, n_layers=4, **variant)
    ids = torch.randint(0, 512, (2, 24))
    for stage in [build_model(config), *split(config, 3)]:
        x = ids if stage.is_first else torch.randn(2, 24, config.d_model)
        params = dict(stage.named_parameters())
        read: list[str] = []
        h = x
        with torch.no_grad():
            for part, names in forward_parts(stage):
                read += names
                h = torch.func.functional_call(part, {"stage." + n: params[n] for n in names}, (h,))
            want = stage(x)
        assert sorted(read) == sorted(params) and len(read) == len(set(read))
        assert torch.equal(h, want), (stage.start, stage.end)


def _held_and_grads(model, x, y) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes ``model``'s forward holds for its backward (beyond the parameters), and the gradients it makes."""
    held, loss = held_for_backward(model, x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return held, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["plain", "subspace", "middle"])
def test_recompute_holds_less_for_the_backward_and_makes_the_same_gradients_bit_for_bit(variant):
    config = preset("tiny", vocab_size=300, n_layers=4,
                    **({"subspace_rank": 16, "subspace_layers": 2} if variant == "subspace" else {}))
    torch.manual_seed(0)
    model = split(config, 3)[1] if variant == "middle" else build_model(config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, config.d_model, generator=g) if variant == "middle" else \
        torch.randint(0, 300, (2, 64), generator=g)
    y = torch.randint(0, 300, (2, 64), generator=g)
    if variant == "middle":  # a middle stage's loss: its output against a fixed projection, as if a head followed
        model.loss_of = lambda x, targets: model(x).float().pow(2).mean()
    held, grads = _held_and_grads(model, x, y)
    model.recompute = True
    held_again, grads_again = _held_and_grads(model, x, y)
    # with it, what the head saves and each block's input (which checkpoint keeps outside autograd's hooks)
    inputs = len(model.blocks) * x.shape[0] * x.shape[1] * config.d_model * 4
    assert inputs < held_again < held / 2, (held_again, inputs, held)
    assert grads_again.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grads_again[name], grad), name


@pytest.mark.parametrize("variant", ["plain", "subspace", "last"])
@pytest.mark.parametrize("tokens", [8, 64])  # the plain head loss; the fused one (fused_head)
def test_a_training_steps_loss_is_the_loss_of_the_logits_with_the_same_gradients(variant, tokens):
    config = preset("tiny", vocab_size=300, n_layers=4,
                    **({"subspace_rank": 16, "subspace_layers": 2} if variant == "subspace" else {}))
    torch.manual_seed(0)
    model = split(config, 2)[1] if variant == "last" else build_model(config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, tokens, config.d_model, generator=g) if variant == "last" else \
        torch.randint(0, 300, (4, tokens), generator=g)
    y = torch.randint(0, 300, (4, tokens), generator=g)
    assert fused_head(y.numel(), 300, config.d_model) == (tokens == 64)
    model.zero_grad(set_to_none=True)
    plain = model.loss(model(x), y)
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model.loss_of(x, y)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    for name, grad in want.items():
        got = model.get_parameter(name).grad
        assert float((got - grad).norm()) <= 1e-5 * float(grad.norm()) + 1e-9, name
    with pytest.raises(ValueError):
        split(config, 2)[0].loss_of(torch.randint(0, 300, (1, 4)), torch.randint(0, 300, (1, 4)))
