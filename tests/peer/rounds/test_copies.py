"""Copy detection: honest replicas overlap partly, a copied payload fully, and resent tensors are recognised."""

from __future__ import annotations

from dataclasses import replace

import torch

from hlbp.peer.rounds.copies import ReuseLog, fingerprint, overlapping_pairs
from hlbp.peer.rounds.outer import Contribution, OuterConfig, SparseLoCo


def _contribution(sender: str, seed: int, anchor: dict[str, torch.Tensor]) -> Contribution:
    g = torch.Generator().manual_seed(seed)
    local = {n: t - 0.01 * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
    return SparseLoCo(OuterConfig(k=64)).contribute(anchor, local, sender, 100)


def _anchor() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(128, 128), "b": torch.zeros(256)}


def test_independent_replicas_are_not_flagged_and_a_copy_is() -> None:
    anchor = _anchor()
    a, b = _contribution("a", 1, anchor), _contribution("b", 2, anchor)
    copy = replace(a, sender="z")  # a free-rider resending a's payload under its own name
    pairs, largest = overlapping_pairs([a, b])
    assert pairs == [] and largest < 0.2
    pairs, largest = overlapping_pairs([a, b, copy])
    assert pairs == [("a", "z", 1.0)] and largest == 1.0


def test_fingerprint_ignores_the_envelope_and_reuse_is_found_across_rounds() -> None:
    anchor = _anchor()
    a, b = _contribution("a", 1, anchor), _contribution("b", 2, anchor)
    assert fingerprint(a) == fingerprint(replace(a, sender="x", tokens=5)) != fingerprint(b)
    log = ReuseLog(window=4)
    assert log.check(0, [a, b]) == []
    fresh = _contribution("a", 3, anchor)
    assert log.check(1, [fresh, replace(b, sender="c")]) == [("c", 0, "b")]
    assert log.check(9, [replace(b, sender="c")]) == []  # older than the window: forgotten
