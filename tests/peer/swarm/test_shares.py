"""The trade of gradients between peers serving one stage (hlbp.peer.swarm.shares): each share checked, the sum
the same bits whoever adds it, and the lineage that says whether the peers' optimizer states agree."""

from __future__ import annotations

import torch

from hlbp.peer.swarm.shares import (
    SHARE_BOUND,
    Trade,
    add_in_order,
    fresh_lineage,
    joint_lineage,
    next_lineage,
    share_fault,
)
from hlbp.protocol.gradshare import Share


def _g(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=gen) * scale, "b": torch.randn(3, generator=gen) * scale}


def test_every_peer_that_adds_the_same_parts_gets_the_same_bits() -> None:
    parts = {"p": _g(1), "q": _g(2, 1e-3), "r": _g(3, 1e4)}
    a = add_in_order(parts)
    b = add_in_order(dict(reversed(list(parts.items()))))
    for name in a:
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32))
    # the order matters for the bits; the rule fixes it
    manual = (parts["p"]["w"] + parts["q"]["w"]) + parts["r"]["w"]
    assert torch.equal(a["w"], manual)
    assert parts["p"]["w"] is not a["w"]  # the parts are not changed


def test_a_trade_completes_when_every_peer_answered_and_every_micro_batch_is_covered_once() -> None:
    trade = Trade("p", 6, frozenset({0, 2, 4}), frozenset({"q", "r"}))
    assert not trade.complete() and trade.missing() == ["q", "r"]
    own = _g(1)
    own_sumsq = float(sum(g.double().pow(2).sum() for g in own.values()))
    assert trade.fault("q", Share(frozenset({1, 3}), _g(2)), own_sumsq) is None
    assert "already" in (trade.fault("r", Share(frozenset({3, 5}), _g(3)), own_sumsq) or "")
    assert "second" in (trade.fault("q", Share(frozenset({5}), _g(3)), own_sumsq) or "")
    assert "did not serve" in (trade.fault("x", Share(frozenset({5}), _g(3)), own_sumsq) or "")
    assert not trade.complete()
    assert trade.fault("r", Share(frozenset({5}), _g(3)), own_sumsq) is None
    assert trade.complete() and not trade.missing()
    total = trade.total(own)
    assert total is not None and torch.equal(total["b"], add_in_order({"p": own, "q": _g(2), "r": _g(3)})["b"])


def test_a_share_far_larger_than_the_receivers_own_part_is_refused() -> None:
    own = 4.0  # squared norm 4: norm 2
    assert share_fault(own, 4, own, 4) is None
    assert share_fault((2 * SHARE_BOUND) ** 2 * 0.99, 1, own, 1) is None
    assert share_fault((2 * SHARE_BOUND) ** 2 * 1.01, 1, own, 1) is not None
    assert share_fault((2 * SHARE_BOUND * 4) ** 2 * 0.99, 16, own, 4) is None  # four times the micro-batches
    assert share_fault((2 * SHARE_BOUND * 4) ** 2 * 1.01, 16, own, 4) is not None
    assert share_fault(float("inf"), 1, own, 1) is not None
    assert share_fault(1e12, 1, 0.0, 0) is None  # nothing of its own to compare with
    # the stage's last traded step is the other reference: an honest small part does not refuse a normal share
    assert share_fault(1.0, 8, 1e-6, 8, last_sumsq=0.25) is None
    assert share_fault((16 * 0.5) ** 2 * 1.01, 8, 1e-6, 8, last_sumsq=0.25) is not None
    trade = Trade("p", 2, frozenset({0}), frozenset({"q"}))
    assert "over" in (trade.fault("q", Share(frozenset({1}), _g(2, 100.0)), 1.0) or "")
    assert not trade.shares


def test_a_share_without_a_gradient_skips_the_step() -> None:
    trade = Trade("p", 2, frozenset({0}), frozenset({"q"}))
    assert trade.fault("q", Share(frozenset({1}), None), 1.0) is None
    assert trade.complete() and trade.total(_g(1)) is None


def test_lineages_agree_only_after_the_same_steps_with_the_same_peers() -> None:
    start = joint_lineage(5, 1, ["q", "p"])
    assert start == joint_lineage(5, 1, ["p", "q"]) and start != joint_lineage(5, 2, ["p", "q"])
    p = next_lineage(start, 5, 1, ["p", "q"])
    q = next_lineage(start, 5, 1, ["q", "p"])
    assert p == q and next_lineage(p, 5, 2, ["p", "q"]) != next_lineage(p, 5, 2, ["p"])
    assert fresh_lineage() != fresh_lineage() and len(fresh_lineage()) == 32
