"""A run's initial weights are keyed by (seed, parameter name): a stage built alone holds exactly its slice of the
whole model, so a stage peer never builds the layers it does not hold."""

from __future__ import annotations

import torch

from hlbp.peer.model.decoder import partition, preset
from hlbp.peer.model.pipeline import initial_stage, initial_state, initial_tensors


def test_each_of_four_stages_of_125m_built_alone_equals_the_whole_models_slice_bit_for_bit() -> None:
    config = preset("125m", vocab_size=512)
    whole = initial_state(config, seed=7)
    covered: set[str] = set()
    for start, end in partition(config.n_layers, 4):
        stage = initial_stage(config, 7, start, end).state_dict()
        assert stage and all(torch.equal(t, whole[n]) for n, t in stage.items())
        covered |= set(stage)
    assert covered == set(whole)  # the stages tile the model: every parameter came from exactly one


def test_single_tensors_match_and_the_seed_decides_everything() -> None:
    config = preset("tiny", vocab_size=256)
    whole = initial_state(config, seed=3)
    names = ["embed.weight", "blocks.2.ffn.w2.weight", "blocks.0.attn_norm.weight", "head.weight"]
    alone = initial_tensors(config, 3, names)
    assert all(torch.equal(alone[n], whole[n]) for n in names)
    assert torch.equal(initial_state(config, seed=3)["head.weight"], whole["head.weight"])  # deterministic
    assert not torch.equal(initial_state(config, seed=4)["head.weight"], whole["head.weight"])
    # GPT-2 style scales: residual writers smaller by sqrt(2 n_layers); norm gains start at one
    assert abs(whole["blocks.2.ffn.w2.weight"].std().item() - 0.02 / (2 * config.n_layers) ** 0.5) < 3e-3
    assert abs(whole["head.weight"].std().item() - 0.02) < 1e-3
    assert torch.equal(whole["blocks.0.attn_norm.weight"], torch.ones(config.d_model))
