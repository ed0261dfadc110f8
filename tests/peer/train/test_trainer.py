"""Inner trainer: schedule, exact resume from a checkpoint, atomic checkpoints, bad input."""

import dataclasses

import pytest
import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data.streams import TokenStream
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.train.checkpoint import load_checkpoint, save_checkpoint
from hlbp.peer.train.trainer import (
    InnerTrainer,
    OptimConfig,
    evaluate,
    evaluate_params,
    lr_at,
    micro_batches,
    skeleton,
    throwaway_step,
    warm_runtime,
)


def _trainer(data, steps=20, init_seed=0):
    torch.manual_seed(init_seed)
    config = preset("tiny", vocab_size=data.vocab_size, n_layers=2, max_seq_len=32)
    model = build_model(config)
    stream = TokenStream(data.train, 32, 4, seed=0, rank=0)
    cfg = OptimConfig(lr=3e-3, warmup_steps=5, total_steps=steps, grad_accum=2)
    return InnerTrainer(model, cfg, micro_batches(stream, cfg.grad_accum), torch.device("cpu"))


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_resume_10_plus_10_equals_20(builtin_data, tmp_path):
    straight = _trainer(builtin_data)
    for _ in range(20):
        straight.train_step()

    first = _trainer(builtin_data)
    for _ in range(10):
        first.train_step()
    tensors, header = first.state_tensors()
    save_checkpoint(tmp_path / "ck.safetensors", tensors, header)
    del first

    resumed = _trainer(builtin_data, init_seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state(*load_checkpoint(tmp_path / "ck.safetensors"))
    assert resumed.step == 10
    for _ in range(10):
        resumed.train_step()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert resumed.tokens == straight.tokens


def test_training_lowers_loss(builtin_data):
    t = _trainer(builtin_data, steps=40)
    first = t.train_step()
    for _ in range(39):
        last = t.train_step()
    assert last < first - 1.0


def test_checkpoint_is_atomic_and_validated(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.ones(3)}, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left behind
    tensors, header = load_checkpoint(path)
    assert header == {"step": 1} and torch.equal(tensors["a"], torch.ones(3))
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserInputError, match="junk"):
        load_checkpoint(tmp_path / "junk.safetensors")
    with pytest.raises(UserInputError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_checkpoint_of_another_model_is_a_user_error(builtin_data, tmp_path):
    t = _trainer(builtin_data)
    tensors, header = t.state_tensors()
    save_checkpoint(tmp_path / "ck.safetensors", tensors, header)
    other = InnerTrainer(
        build_model(preset("tiny", vocab_size=builtin_data.vocab_size, n_layers=3, max_seq_len=32)),
        t.cfg, t.batch_fn, torch.device("cpu"),
    )
    with pytest.raises(UserInputError, match="does not match"):
        other.load_state(*load_checkpoint(tmp_path / "ck.safetensors"))


@pytest.mark.parametrize(
    "change", [{"lr": 0.0}, {"lr": float("nan")}, {"grad_accum": 0}, {"min_lr_ratio": 2.0}, {"total_steps": 0}]
)
def test_bad_optimizer_settings(change):
    with pytest.raises(UserInputError):
        dataclasses.replace(OptimConfig(), **change).validate()


def test_a_warm_up_pass_changes_nothing(builtin_data):
    # a peer joining a run under way takes its first (slow) pass early; the steps after it are bit for bit those of
    # a trainer that never warmed up
    cold, warm = _trainer(builtin_data), _trainer(builtin_data)
    warm.warm_up()
    assert (warm.step, warm.tokens, warm.optimizer.state) == (0, 0, {})
    assert all(p.grad is None for p in warm.model.parameters())
    for _ in range(3):
        assert warm.train_step() == cold.train_step()
    for (name, a), b in zip(cold.model.state_dict().items(), warm.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_step_leaves_no_gradients_and_a_skeleton_scores_parameters_without_a_copy(builtin_data):
    """Gradients do not outlive their step (a round between two steps would hold them for nothing), and a
    skeleton of the model (meta parameters, shared buffers) scores given tensors exactly as the model loaded with
    them does."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=builtin_data.vocab_size))
    stream = TokenStream(builtin_data.train, 32, 2, seed=0)
    trainer = InnerTrainer(model, OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10), micro_batches(stream, 1),
                           torch.device("cpu"))
    trainer.train_step()
    assert all(p.grad is None for p in model.parameters())
    shell = skeleton(model)
    assert all(p.is_meta for p in shell.parameters())
    assert all(b is dict(model.named_buffers())[n] for n, b in shell.named_buffers())
    params = {n: p.detach() + 0.01 for n, p in model.named_parameters()}
    batches = [stream.batch(i) for i in range(2)]
    scored = evaluate_params(shell, params, batches, torch.device("cpu"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    assert scored == evaluate(model, batches, torch.device("cpu"))


@pytest.mark.parametrize("subspace", [0, 16])
def test_the_runtime_warm_up_step_runs_a_one_block_model_of_the_run_and_touches_nothing_else(subspace):
    """The step a peer takes before its memory baseline builds a one-block model of the run's width (the
    constrained network too) and trains it one step; the global generator is where it was."""
    config = preset("tiny", vocab_size=300, max_seq_len=32, subspace_rank=subspace,
                    subspace_layers=3 if subspace else None)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    with torch.no_grad():  # as a caller may be
        loss = throwaway_step(config, OptimConfig(lr=1e-3, moments="bf16"), torch.device("cpu"), 2, 64)
    assert 0 < loss < 20
    torch.manual_seed(0)
    warm_runtime(config, OptimConfig(lr=1e-3), torch.device("cpu"), 2, 64)
    assert torch.equal(torch.rand(3), before)  # not even the global generator moved


def test_scoring_reads_one_blocks_parameters_at_a_time(builtin_data):
    """evaluate_params on parameters a view makes when read (a round's candidate, a store's file) holds one step of
    the forward's at a time: never more than the largest block's tensors are alive together."""
    import weakref

    from hlbp.peer.model.decoder import forward_parts

    model = build_model(preset("tiny", vocab_size=builtin_data.vocab_size))
    live: set[int] = set()
    most = [0]

    class Made(dict):
        def __getitem__(self, name):
            t = super().__getitem__(name).detach().clone()  # a fresh tensor per read, as a store's
            live.add(id(t))
            weakref.finalize(t, live.discard, id(t))
            most[0] = max(most[0], len(live))
            return t

    params = Made(model.named_parameters())
    batches = [TokenStream(builtin_data.train, 32, 2, seed=0).batch(i) for i in range(2)]
    scored = evaluate_params(skeleton(model), params, batches, torch.device("cpu"))
    assert scored == evaluate(model, batches, torch.device("cpu"))
    assert most[0] == max(len(names) for _, names in forward_parts(model))


def test_above_a_warmed_baseline_a_cpu_model_costs_its_parameters_and_their_moments():
    """In a fresh process on the CPU: with the runtime warmed before the baseline (as a peer marks it), a built
    model holds 4 bytes per parameter above it and, between training steps, 12 (parameters and AdamW's float32
    moments), within 1.5; without the warm-up the runtime's first-use memory lands in the per-parameter figure."""
    import subprocess
    import sys

    code = """
import sys, torch
from hlbp.peer.common import memory
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, warm_runtime
memory.limit_arenas()
torch.set_num_threads(1)
config, optim = preset("tiny", vocab_size=8192), OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)
warm = (lambda: warm_runtime(config, optim, torch.device("cpu"), 4, 64)) if sys.argv[1] == "warm" else None
base = memory.mark_baseline(torch.device("cpu"), warm=warm)
model = build_model(config)
n = sum(p.numel() for p in model.parameters())
built = (memory.current_host_bytes() - base) / n
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 8192, (4, 65), generator=g)
trainer = InnerTrainer(model, optim, lambda step, micro: (x[:, :-1], x[:, 1:]), torch.device("cpu"))
for _ in range(3):
    trainer.train_step()
memory.trim()
print(f"{built:.2f} {(memory.current_host_bytes() - base) / n:.2f}")
"""
    figures = {}
    for how in ("warm", "cold"):
        out = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=300,
                             check=True)
        figures[how] = [float(v) for v in out.stdout.split()[-2:]]
    built, between = figures["warm"]
    assert abs(built - 4) < 1 and abs(between - 12) < 1.5, figures
    assert figures["cold"][1] > between + 2, figures  # what the warm-up keeps out of the budget
