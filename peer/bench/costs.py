"""What applying a round costs a peer's CPU at the ``1b`` preset's tensor sizes, capped or all-to-all.

A round's apply decodes every accepted payload, aggregates them into the anchor, and checks every pair of them
for copied indices (:mod:`hlbp.peer.rounds.copies`). Under a gather cap F those are F decodes, one aggregation of
F and F (F - 1) / 2 pairs, whatever N is; all-to-all, they grow with N and N². Measured on synthetic
contributions (SparseLoCo of random pseudo-gradients, encoded to the wire and back) over one transformer layer of
the preset (its 9 tensors), and scaled by the preset's parameter count over that layer's: every step is linear in
the values it touches, so the scale is exact up to the embedding's shape.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hlbp.peer.model.decoder import build_model, preset
from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.copies import overlapping_pairs
from hlbp.peer.rounds.outer import OuterConfig, SparseLoCo


def layer_shapes(model: str = "1b") -> tuple[dict[str, tuple[int, ...]], int]:
    """The tensor shapes of one transformer layer of ``model``, and the preset's total parameter count."""
    cfg = preset(model, vocab_size=32000)
    with torch.device("meta"):
        net = build_model(cfg)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    total = sum(p.numel() for p in net.parameters())
    layer = {n: s for n, s in shapes.items() if ".0." in n}
    return layer, total


def apply_costs(contributors: int, model: str = "1b", seed: int = 0) -> dict[str, Any]:
    """Seconds to decode, aggregate and copy-check ``contributors`` contributions, for the whole ``model``
    (measured on one layer and scaled)."""
    shapes, total = layer_shapes(model)
    layer_params = sum(torch.Size(s).numel() for s in shapes.values())
    scale = total / layer_params
    cfg = OuterConfig(k=64, aggregation="selectors", clip_median=True)
    g = torch.Generator().manual_seed(seed)
    anchor = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    blobs = []
    for i in range(contributors):
        local = {n: t - 1e-3 * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
        c = SparseLoCo(cfg).contribute(anchor, local, f"peer{i}", 1)
        blobs.append(contribution_to_bytes(c, cfg, run="bench", round=0, shard=0))
    t0 = time.perf_counter()
    decoded = [contribution_from_bytes(b, cfg, shapes, run="bench", round=0, shard=0) for b in blobs]
    t1 = time.perf_counter()
    SparseLoCo(cfg).apply(anchor, decoded)
    t2 = time.perf_counter()
    overlapping_pairs(decoded)
    t3 = time.perf_counter()
    return {"contributors": contributors, "model": model, "params": total, "measured_params": layer_params,
            "payload_bytes": round(sum(map(len, blobs)) / len(blobs) * scale),
            "decode_s": (t1 - t0) * scale, "aggregate_s": (t2 - t1) * scale, "copy_check_s": (t3 - t2) * scale,
            "total_s": (t3 - t0) * scale}
