"""CompactAdamW: torch's fused AdamW with its moments stored in bfloat16 between steps."""

import pytest
import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data.streams import TokenStream
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.train.adamw import CompactAdamW
from hlbp.peer.train.checkpoint import load_checkpoint, save_checkpoint
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, micro_batches


def _trainer(data, moments="fp32", init_seed=0):
    torch.manual_seed(init_seed)
    config = preset("tiny", vocab_size=data.vocab_size, n_layers=2, max_seq_len=32)
    stream = TokenStream(data.train, 32, 4, seed=0, rank=0)
    cfg = OptimConfig(lr=3e-3, warmup_steps=5, total_steps=30, moments=moments)
    return InnerTrainer(build_model(config), cfg, micro_batches(stream, 1), torch.device("cpu"))


def _steps(t, n):
    return [t.train_step() for _ in range(n)]


def test_with_float32_moments_it_is_torch_adamw_bit_for_bit(builtin_data):
    """The per-parameter stepping itself changes nothing: stored in float32 it equals the fused AdamW exactly."""
    ref, compact = _trainer(builtin_data), _trainer(builtin_data)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in compact.optimizer.param_groups]
    compact.optimizer = CompactAdamW(groups, layout="fp32", lr=3e-3, betas=(0.9, 0.95))
    assert _steps(ref, 6) == _steps(compact, 6)
    for a, b in zip(ref.model.parameters(), compact.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("layout", "per_param"), [("bf16", 4), ("v-bf16", 6)])
def test_bf16_moments_shrink_the_state_and_train_like_float32(builtin_data, layout, per_param):
    ref, compact = _trainer(builtin_data), _trainer(builtin_data, layout)
    losses_ref, losses = _steps(ref, 30), _steps(compact, 30)
    states = list(compact.optimizer.state.values())
    assert states and all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)
    assert all(s["exp_avg"].dtype == (torch.bfloat16 if layout == "bf16" else torch.float32) for s in states)
    held = sum(s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq"))
    assert held == per_param * sum(p.numel() for p in compact.model.parameters())
    assert losses[-1] < losses[0] - 1.0
    assert abs(losses[-1] - losses_ref[-1]) < 0.02 * losses_ref[-1]  # the same training, to the moments' rounding


def test_a_checkpoint_resumes_bf16_moments_exactly(builtin_data, tmp_path):
    straight = _trainer(builtin_data, "bf16")
    _steps(straight, 12)
    first = _trainer(builtin_data, "bf16")
    _steps(first, 6)
    tensors, header = first.state_tensors()
    assert tensors["optim.0.exp_avg"].dtype == torch.bfloat16  # saved as held
    save_checkpoint(tmp_path / "ck.safetensors", tensors, header)
    resumed = _trainer(builtin_data, "bf16", init_seed=5)
    resumed.load_state(*load_checkpoint(tmp_path / "ck.safetensors"))
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in resumed.optimizer.state.values())
    _steps(resumed, 6)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_an_unknown_moment_dtype_is_a_user_error():
    with pytest.raises(UserInputError, match="moments"):
        OptimConfig(moments="fp8").validate()


@pytest.mark.parametrize("layout", ["bf16", "v-bf16"])
def test_narrow_moments_step_a_block_at_a_time_bit_for_bit(builtin_data, monkeypatch, layout):
    """Stepping a parameter a block of values at a time (the transient is one block's float32 moments) gives the
    whole parameter's values and moments exactly, including blocks that split a row and a short last block."""
    from hlbp.peer.train import adamw

    whole = _trainer(builtin_data, layout)
    _steps(whole, 4)
    monkeypatch.setattr(adamw, "BLOCK_VALUES", 96)
    blocked = _trainer(builtin_data, layout)
    assert any(p.numel() > 96 and p.numel() % 96 for p in blocked.model.parameters())
    _steps(blocked, 4)
    for a, b in zip(whole.model.parameters(), blocked.model.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(whole.optimizer.state.values(), blocked.optimizer.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))

