"""The round guard's pure rules: bounds relative to the shard's scale, deterministic verdicts and culprits."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hlbp.peer.common.spill import BLOCK_BYTES, SpilledTensors, Streamed
from hlbp.peer.rounds import guard
from hlbp.peer.rounds.anchor import Anchor
from hlbp.peer.rounds.guard import GuardConfig
from hlbp.peer.rounds.outer import Contribution, OuterConfig, SparseLoCo

CFG = GuardConfig(max_contribution_ratio=8.0, max_update_ratio=2.0)


def _anchor() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g) * 0.02, "b": torch.ones(64)}


def _honest(anchor: dict[str, torch.Tensor], sender: str, seed: int) -> Contribution:
    g = torch.Generator().manual_seed(seed)
    local = {n: t - 0.01 * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
    return SparseLoCo(OuterConfig(k=64)).contribute(anchor, local, sender, 100)


def test_norm_is_float64_and_infinite_on_non_finite() -> None:
    assert guard.norm({"a": torch.tensor([3.0, 4.0])}) == 5.0
    assert guard.norm({"a": torch.tensor([1.0, float("nan")])}) == math.inf
    assert guard.norm({"a": torch.full((4,), 3e38)}) == pytest.approx(6e38)  # float32 squares would overflow
    assert guard.scale({"a": torch.zeros(3)}) == guard.MIN_SCALE


class _BlocksOnly(Mapping[str, torch.Tensor]):
    """A kept store that refuses whole reads: what it hands out, it hands out a block at a time."""

    def __init__(self, store: SpilledTensors) -> None:
        self.store, self.blocks = store, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        raise AssertionError(f"{name} was read whole")

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)

    def stream(self, name: str) -> Streamed:
        streamed = self.store.stream(name)

        def counted() -> Iterator[torch.Tensor]:
            for block in streamed.blocks:
                self.blocks += 1
                yield block
        return Streamed(streamed.dtype, streamed.shape, counted())


def test_a_kept_anchors_scale_is_read_a_block_at_a_time_with_the_same_bits(tmp_path: Path) -> None:
    # the exchange thread takes the anchor's norm while a training step runs beside it: a whole read of each
    # parameter (every one at once, before) was a model-sized transient at the step's peak
    g = torch.Generator().manual_seed(3)
    per_block = BLOCK_BYTES // 4
    params = {"emb": torch.randn(per_block * 2 + 12345, generator=g), "w": torch.randn(300, 7, generator=g),
              "b": torch.randn(5, generator=g) * 1e3}
    whole = guard.scale(params)
    assert whole == pytest.approx(math.sqrt(sum(float(t.double().square().sum()) for t in params.values())), rel=1e-12)
    store = SpilledTensors(tmp_path)
    for n, t in params.items():
        store[n] = t
    blocks = _BlocksOnly(store)
    assert guard.scale(blocks) == whole  # the same chunks summed in the same order: the same bits
    assert blocks.blocks == 3 + 1 + 1  # the large parameter in three blocks, the others in one each
    assert guard.scale(blocks, ["w", "b"]) == guard.scale({"w": params["w"], "b": params["b"]})
    anchor = Anchor(params, spill_dir=str(tmp_path))  # as a full replica keeps it (--state-on-disk)
    assert guard.scale(anchor, list(params)) == whole
    store.close()


def test_oversized_catches_scaled_outsized_and_nan_contributions() -> None:
    anchor = _anchor()
    scale = guard.scale(anchor)
    honest = _honest(anchor, "a", 1)
    t = honest.tensors["w"]
    scaled = Contribution("s", 100, {**honest.tensors, "w": replace(t, table=t.table * 1e6, shift=t.shift * 1e6)})
    huge = Contribution("h", 100, {**honest.tensors, "w": replace(t, table=torch.tensor([-1e30, -1e29, 1e29, 1e30]))})
    nan = Contribution("n", 100, {**honest.tensors, "w": replace(t, table=torch.full((4,), float("nan")))})
    norms = {c.sender: guard.contribution_norm(c) for c in (honest, scaled, huge, nan)}
    over = guard.oversized(norms, scale, CFG)
    assert set(over) == {"s", "h", "n"}
    assert norms["a"] / scale < 0.5  # an honest pseudo-gradient is far below the bound
    assert over["n"] == math.inf and over["h"] > 1e20 and over["s"] > 1e4


def test_update_bound_and_reasons() -> None:
    old = _anchor()
    fine = {n: t * 1.1 for n, t in old.items()}
    assert guard.refuse_reason(guard.update_ratio(old, fine), CFG) is None
    wild = {n: t * 10 for n, t in old.items()}
    assert "9x the parameters'" in guard.refuse_reason(guard.update_ratio(old, wild), CFG)
    broken = {**old, "b": torch.full((64,), float("inf"))}
    assert guard.refuse_reason(guard.update_ratio(old, broken), CFG) == "the new parameters are not finite"


def test_culprits_are_the_same_on_every_peer() -> None:
    norms = {"c": 2.0, "a": 5.0, "b": 5.0, "d": float("nan")}
    assert guard.culprits(norms) == ["d"]  # NaN counts as the largest
    assert guard.culprits({k: v for k, v in norms.items() if k != "d"}, k=2) == ["a", "b"]  # ties by sender id


def test_loss_jump_rule() -> None:
    assert guard.loss_reason([], 9.0, CFG) is None  # after a start or a sync only finiteness counts
    assert guard.loss_reason([], float("nan"), CFG) == "the loss on the guard batch is not finite"
    assert guard.loss_reason([7.0], 8.5, CFG) is None  # an honest bad round
    assert "jumped from 7 to 80" in guard.loss_reason([7.0], 80.0, CFG)
    assert guard.loss_reason([7.0], float("inf"), CFG) == "the loss on the guard batch is not finite"


def test_the_loss_guard_catches_a_slow_climb() -> None:
    # the attack seen live: each round under the 10x jump bound (8.11 -> 14.6 -> 79 -> 664 ...)
    climb = [8.11, 14.6, 79.0, 664.0]
    refused_at = next(i for i in range(1, len(climb)) if guard.loss_reason(climb[:i], climb[i], CFG))
    assert refused_at == 2  # 79 is 9.7x the lowest of the rounds before: refused before it compounds
    assert "climbed to 79" in guard.loss_reason(climb[:2], 79.0, CFG)
    honest = [9.0, 7.9, 7.4, 7.6, 7.1, 7.3, 6.9]  # training noise on a fixed batch: never refused
    assert all(guard.loss_reason(honest[:i], honest[i], CFG) is None for i in range(1, len(honest)))
    # only the last LOSS_WINDOW rounds count: an old low point does not hold a later plateau hostage
    assert guard.loss_reason([1.0] + [3.0] * guard.LOSS_WINDOW, 3.5, CFG) is None


def test_a_contribution_far_above_the_rounds_median_is_an_outlier_on_every_peer() -> None:
    cfg = GuardConfig(max_vs_median=8.0)
    honest = {"h1": 0.30, "h2": 0.35, "h3": 0.41}
    assert guard.outliers(honest, cfg) == {}
    assert guard.outliers({**honest, "x": 7.9 * 10}, cfg) == {"x": pytest.approx(7.9 * 10 / 0.35)}
    assert guard.outliers({**honest, "x": 8.0 * 0.35}, cfg) == {}  # at the bound: kept
    # removed largest first until none is left: the two liars go, whatever order they came in
    assert set(guard.outliers({**honest, "y": 50.0, "x": 20.0}, cfg)) == {"x", "y"}
    assert guard.outliers({"h1": 0.3, "x": 100.0}, cfg) == {}  # two: either could be the honest one
    assert guard.outliers({"h1": 0.0, "h2": 0.0, "x": 1.0}, cfg) == {}  # no scale to judge by
    assert set(guard.outliers({**honest, "x": math.inf}, cfg)) == {"x"}
    # a peer that caught up with a sixth of the steps does not make the others outliers
    assert guard.outliers({"full1": 0.4, "full2": 0.45, "late": 0.4 / 6}, cfg) == {}


def test_a_second_undelivered_contribution_within_the_window_bans_its_sender() -> None:
    from hlbp.peer.rounds.bans import MISS_WINDOW, RoundBans

    bans = RoundBans()
    bans.miss(3, "fake")
    assert not bans.banned("fake", 4)  # one miss: a flaky link, left out of that round only
    bans.miss(3 + MISS_WINDOW, "fake")
    assert not bans.banned("fake", 4 + MISS_WINDOW)  # the first has left the window
    bans.miss(4 + MISS_WINDOW, "fake")
    assert bans.banned("fake", 5 + MISS_WINDOW)


def test_who_scores_a_round_and_whom_a_refusal_blames() -> None:
    # a full replica scores every round itself, against the anchor's loss right after a start or a sync
    assert guard.loss_check(4, 4, [4, 1, 1], has_window=True) == guard.LossCheck(score=True, anchor=False, blame=True)
    assert guard.loss_check(4, 4, [1, 1], has_window=False) == guard.LossCheck(score=True, anchor=True, blame=True)
    # a stage peer leaves a round with a full replica to that replica's guard and votes; without one its chain
    # scores the result, whatever its own window holds (every stage of the chain decides alike), and it blames nobody
    assert guard.loss_check(1, 4, [4, 1, 1, 1, 1], has_window=True).score is False
    for has_window in (True, False):
        assert guard.loss_check(1, 4, [1, 1, 1, 1], has_window) == guard.LossCheck(score=True, anchor=False,
                                                                                      blame=False)
