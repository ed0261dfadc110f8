"""How the driver cuts a step's batch into micro-batches (:func:`hlbp.peer.swarm.step.micro_batch_rows`)."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.swarm.step import Schedule, micro_batch_rows, micro_batches


@pytest.mark.parametrize("rows,count", [(64, 16), (64, 8), (8, 4), (7, 4), (10, 3), (3, 8), (1, 1), (33, 5)])
def test_uniform_cuts_as_tensor_split_does(rows: int, count: int) -> None:
    expected = [len(c) for c in torch.tensor_split(torch.arange(rows), min(rows, count))]
    assert micro_batch_rows(rows, count, Schedule.UNIFORM) == expected


@pytest.mark.parametrize("rows,count,expected", [
    (64, 16, [1, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4, 1]),  # the bench's 16 of 64: edges of one row
    (64, 8, [2, 10, 10, 10, 10, 10, 10, 2]),  # a quarter of the 8 rows the others would have had
    (8, 4, [1, 3, 3, 1]),
    (4, 4, [1, 1, 1, 1]),  # a row each: nothing to taper
    (6, 3, [2, 2, 2]),  # fewer than 4 micro-batches: uniform
    (2, 8, [1, 1]),  # never more micro-batches than rows
])
def test_tapered_shortens_the_first_and_the_last(rows: int, count: int, expected: list[int]) -> None:
    assert micro_batch_rows(rows, count, Schedule.TAPERED) == expected


def test_every_row_lands_in_exactly_one_micro_batch() -> None:
    for rows in range(1, 70):
        for count in (1, 2, 4, 8, 16):
            for schedule in Schedule:
                sizes = micro_batch_rows(rows, count, schedule)
                assert sum(sizes) == rows and len(sizes) == min(rows, count) and min(sizes) >= 1, (rows, count)


def test_the_micro_batches_are_the_batch_in_order_weighted_by_their_tokens() -> None:
    x = torch.arange(64 * 5).reshape(64, 5)
    y = x + 1
    for schedule in Schedule:
        mbs = micro_batches(x, y, 16, schedule)
        assert torch.equal(torch.cat([m.x for m in mbs]), x) and torch.equal(torch.cat([m.y for m in mbs]), y)
        assert [m.weight for m in mbs] == [m.y.numel() / y.numel() for m in mbs]
        assert sum(m.weight for m in mbs) == pytest.approx(1.0, abs=1e-12)
    assert [m.x.shape[0] for m in micro_batches(x, y, 16)] == [4] * 16  # uniform unless asked
