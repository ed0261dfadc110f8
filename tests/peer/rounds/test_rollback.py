"""A replica whose inner loss stops being finite rolls back to the round's global parameters and goes on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.loop import ReplicaBase, RoundConfig, RoundStats
from hlbp.peer.rounds.outer import OuterConfig
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig
from hlbp.protocol.identity import Identity


class _Replica(ReplicaBase):
    """Only the inner phase runs here: no DHT, no transport."""

    def run_round(self) -> RoundStats:
        return RoundStats(round=self.round)

    def round_closed(self, r: int, wait: bool = True) -> bool:
        return False


def _batches(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (2, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def test_a_non_finite_inner_loss_rolls_back_instead_of_exiting() -> None:
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=256))
    # an absurd learning rate without clipping drives the loss to inf/NaN within a few steps
    trainer = InnerTrainer(model, OptimConfig(lr=1e4, warmup_steps=1, total_steps=100, grad_clip=0.0), _batches,
                           torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    replica = _Replica(None, Identity.generate(), None, trainer, OuterConfig(), [names],  # type: ignore[arg-type]
                       RoundConfig(run_id="t", inner_steps=50), threading.Event())
    anchor = {n: t.clone() for n, t in replica.state.anchor.items()}
    steps, tokens = replica.phase.run(0)
    assert (steps, tokens) == (0, 0)  # the round is sat out: nothing to contribute
    assert replica.phase.rollbacks == 1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), anchor[n]), n  # back at the round's global parameters
    assert not trainer.optimizer.state  # fresh AdamW moments


def _checkpointed(tmp_path) -> tuple[Callable[[], _Replica], list[str], Path]:
    """A maker of replicas that share one tiny model's trainer and one checkpoint file, its names and that path."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=256))
    trainer = InnerTrainer(model, OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10), _batches, torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    ckpt = tmp_path / "checkpoint.safetensors"

    def replica() -> _Replica:
        return _Replica(None, Identity.generate(), None, trainer, OuterConfig(), [names],  # type: ignore[arg-type]
                        RoundConfig(run_id="t", inner_steps=2), threading.Event(), checkpoint=ckpt)

    return replica, names, ckpt


def test_non_finite_global_parameters_are_never_saved_or_resumed(tmp_path) -> None:
    replica, names, ckpt = _checkpointed(tmp_path)

    first = replica()
    first.state.round = 3
    first.save()
    saved = ckpt.read_bytes()
    first.state.anchor[names[0]][0] = float("nan")
    first.state.round = 4
    first.save()  # refused: the checkpoint on disk stays the last good one
    assert ckpt.read_bytes() == saved
    second = replica()
    assert second.checkpoints.resume(second.state) and second.round == 3
    # a checkpoint that does hold non-finite global parameters (written by an older version, say) is ignored
    from hlbp.peer.train.checkpoint import load_checkpoint, save_checkpoint

    tensors, header = load_checkpoint(ckpt)
    tensors[f"anchor.{names[0]}"][0] = float("inf")
    save_checkpoint(ckpt, tensors, header)
    assert not (r := replica()).checkpoints.resume(r.state)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "garbage"])
def test_a_damaged_checkpoint_is_moved_aside_and_the_replica_starts_without_it(tmp_path, damage: str) -> None:
    replica, _names, ckpt = _checkpointed(tmp_path)

    first = replica()
    first.state.round = 3
    first.save()
    data = bytearray(ckpt.read_bytes())
    if damage == "flipped":
        data[-7] ^= 0x10  # a tensor byte: the file's layout stays valid
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"\x00" * 64)
    ckpt.write_bytes(bytes(data))
    second = replica()
    assert not second.checkpoints.resume(second.state)  # no exception: the round loop syncs from peers instead
    assert second.round == 0
    assert not ckpt.exists()
    (aside,) = tmp_path.glob("checkpoint.safetensors.unusable-*")
    assert aside.read_bytes() == bytes(data)  # kept, for whoever wants to look at it
