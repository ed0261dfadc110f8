"""Stale inner gradients (hlbp.peer.sim.stale): where each step's gradient is taken, checked against plain trainers
stepping by hand, bit for bit."""

from __future__ import annotations

import torch

from hlbp.peer.data.streams import TokenStream
from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.sim.stale import Staleness, StaleSteps
from hlbp.peer.train.trainer import InnerTrainer, OptimConfig, micro_batches


def _trainer(data, weight_decay: float = 0.1) -> InnerTrainer:
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=data.vocab_size, n_layers=2, max_seq_len=32)
    stream = TokenStream(data.train, 32, 4, seed=0, rank=0)
    cfg = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=20, weight_decay=weight_decay)
    return InnerTrainer(build_model(config), cfg, micro_batches(stream, 1), torch.device("cpu"))


def _weights(t: InnerTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_gradient_taken_at_the_own_weights_is_a_plain_step(builtin_data) -> None:
    plain, at_own = _trainer(builtin_data), _trainer(builtin_data)
    for _ in range(3):
        plain.train_step()
        at_own.train_step(grad_at=_weights(at_own))
    assert _equal(_weights(plain), _weights(at_own))


def test_a_gradient_taken_elsewhere_moves_the_own_weights_by_that_gradients_step(builtin_data) -> None:
    # without weight decay, AdamW's first step depends on the gradient alone: a trainer at w' stepping with the
    # gradient taken at w moves exactly as a trainer at w does, from where it is
    at_w, elsewhere = _trainer(builtin_data, 0.0), _trainer(builtin_data, 0.0)
    w = _weights(at_w)
    with torch.no_grad():
        for p in elsewhere.model.parameters():
            p.add_(0.01)
    w_prime = _weights(elsewhere)
    at_w.train_step()
    elsewhere.train_step(grad_at=w)
    moved = _weights(at_w)
    for n in w:
        assert torch.allclose(_weights(elsewhere)[n] - w_prime[n], moved[n] - w[n], atol=1e-7)
    assert not _equal(_weights(elsewhere), moved)


def test_stale_steps_take_each_gradient_before_the_previous_update_and_drain_makes_one_fresh(builtin_data) -> None:
    stale, hand = _trainer(builtin_data), _trainer(builtin_data)
    steps = StaleSteps(stale, Staleness.STALE)
    history = [_weights(hand)]
    steps.step()
    hand.train_step()  # the first step has nothing older: fresh
    assert _equal(_weights(stale), _weights(hand))
    for _ in range(3):
        history.append(_weights(hand))
        steps.step()
        hand.train_step(grad_at=history[-2])  # the weights before the previous step
        assert _equal(_weights(stale), _weights(hand))
    steps.drain()
    steps.step()
    hand.train_step()
    assert _equal(_weights(stale), _weights(hand))


def test_a_look_ahead_takes_the_gradient_at_the_stale_weights_pushed_on_by_the_last_change(builtin_data) -> None:
    ahead, hand = _trainer(builtin_data), _trainer(builtin_data)
    steps = StaleSteps(ahead, Staleness.LOOKAHEAD)
    history = [_weights(hand)]
    for i in range(4):
        steps.step()
        if i == 0:
            hand.train_step()
        elif i == 1:
            hand.train_step(grad_at=history[0])  # only one older set of weights yet: plain stale
        else:
            older, oldest = history[-2], history[-3]
            hand.train_step(grad_at={n: 2 * older[n] - oldest[n] for n in older})
        history.append(_weights(hand))
        assert _equal(_weights(ahead), _weights(hand))
