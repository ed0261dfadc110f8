"""Bounded influence: one contribution anywhere under the round's norm bound moves the update at most a stated
small multiple of what an honest contribution moves it, in both aggregation forms.

A real SparseLoCo round in process: three honest replicas contribute the pseudo-gradient of a little inner
progress; the attacker sends a sign-flipped pseudo-gradient along its own random direction (so it alone selects
most of its coordinates), scaled to a norm from 0.5x to just under 8x the parameters' norm (the guard's bound
refuses anything above). A contribution's influence is how far it moves the three honest replicas' update when it
joins them; an honest fourth replica's is the yardstick.
"""

from __future__ import annotations

import math

import pytest
import torch

from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo

MAX_MULTIPLE = 2.0  # the attacker's influence is at most this many times the largest honest one
SHAPES = {"w": (256, 256), "b": (1024,)}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def _influences(aggregation: str, attacker_ratio: float) -> tuple[float, float]:
    cfg = OuterConfig(k=64, aggregation=aggregation, clip_median=True)
    g = torch.Generator().manual_seed(0)
    anchor = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    honest = []
    for seed in (1, 2, 3, 4):  # honest: a little inner progress along a shared direction plus noise
        h = torch.Generator().manual_seed(seed)
        local = {n: t - 0.01 * (torch.ones_like(t) + torch.randn(t.shape, generator=h)) for n, t in anchor.items()}
        honest.append(SparseLoCo(cfg).contribute(anchor, local, f"h{seed}", 100))
    a = torch.Generator().manual_seed(99)
    direction = {n: torch.randn(t.shape, generator=a) for n, t in anchor.items()}
    scale = attacker_ratio * _norm(anchor) / _norm(direction)
    local = {n: anchor[n] + scale * direction[n] for n in anchor}  # sign-flipped: Δ = anchor - local = -scale·d
    attacker = SparseLoCo(cfg).contribute(anchor, local, "attacker", 100)

    def update(cs: list) -> dict[str, torch.Tensor]:
        return SparseLoCo(cfg).aggregate(cs, list(anchor))

    base = update(honest[:3])

    def moved(fourth: object) -> float:
        joined = update([*honest[:3], fourth])
        return _norm({n: joined[n] - base[n] for n in base})

    return moved(attacker), moved(honest[3])


@pytest.mark.parametrize("aggregation", ["selectors", "mean"])
@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0, 4.0, 7.9])
def test_one_contribution_under_the_bound_moves_the_update_at_most_a_small_multiple(aggregation: str,
                                                                                    ratio: float) -> None:
    attacker, honest = _influences(aggregation, ratio)
    assert attacker <= MAX_MULTIPLE * honest, (attacker, honest, attacker / honest)
