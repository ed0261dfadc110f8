"""The anchor store: per-parameter replacement, snapshots read back bit for bit from undo records, and the old
tensors released at once; each alike with the current tensors kept in memory or in a file."""

import gc
import weakref

import pytest
import torch

from hlbp.peer.rounds.anchor import Anchor


@pytest.fixture(params=["memory", "disk"])
def spill(request, tmp_path) -> str:
    """Where the anchor keeps its current tensors: "" in memory, else a directory for its file."""
    return str(tmp_path) if request.param == "disk" else ""


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(100, generator=g)}


def _sparse_step(t: torch.Tensor, seed: int, frac: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(t.shape, generator=g) < frac
    return torch.where(mask, t - 0.01 * torch.randn(t.shape, generator=g), t)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_snapshot_reads_each_earlier_version_bit_for_bit_after_sparse_and_dense_writes(spill):
    start = _params(0)
    start["b"][3] = 0.0
    anchor = Anchor(start, spill_dir=spill)
    v0 = anchor.snapshot()
    one = {n: _sparse_step(t, 1) for n, t in start.items()}
    one["b"] = one["b"].clone()
    one["b"][3] = -0.0  # equal as a float, different bits: the record keeps it
    anchor.update(one)
    v1 = anchor.snapshot()
    two = {"w": start["w"] * 2.0, "b": _sparse_step(one["b"], 2)}  # a dense write, then a sparse one
    anchor.update(two)
    for n in start:
        assert _bits_equal(v0[n], start[n]) and _bits_equal(v1[n], one[n]) and _bits_equal(anchor[n], two[n])
        assert (anchor[n] is two[n]) == (not spill)  # in memory: the current tensor itself, no copy
    assert list(v0) == list(start) and len(v1) == 2 and "w" in v1


def test_undo_records_live_only_while_a_snapshot_needs_them(spill):
    anchor = Anchor(_params(0), spill_dir=spill)
    anchor.update({n: _sparse_step(t, 1) for n, t in anchor.items()})
    assert anchor.held_records() == 0  # nobody held the old version: nothing kept
    snap = anchor.snapshot()
    anchor.update({n: _sparse_step(t, 2) for n, t in anchor.items()})
    assert anchor.held_records() == 2
    del snap
    gc.collect()
    assert anchor.held_records() == 0


def test_a_sparse_write_releases_the_old_tensor_even_while_a_snapshot_of_it_lives(spill):
    """The memory point: the replaced tensor is freed; the snapshot keeps only the changed positions."""
    start = _params(0)
    anchor = Anchor(start, spill_dir=spill)
    snap = anchor.snapshot()
    old = weakref.ref(start["w"])
    new_w = _sparse_step(start["w"], 1)
    del start
    anchor["w"] = new_w
    gc.collect()
    assert old() is None
    assert not _bits_equal(snap["w"], new_w)  # still readable


def test_restore_puts_back_what_was_written_since_a_snapshot(spill):
    start = _params(0)
    anchor = Anchor(start, spill_dir=spill)
    before = anchor.snapshot()
    anchor.update({n: _sparse_step(t, 1) for n, t in start.items()})
    anchor["w"] = start["w"] + 1.0
    anchor.restore(before)
    assert all(_bits_equal(anchor[n], start[n]) for n in start)


def _positions(numel: int, seed: int, frac: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(numel, generator=g) < frac).nonzero().reshape(-1)


@pytest.mark.parametrize("frac", [0.0, 0.02, 0.9])  # none, sparse, and past DENSE_FRACTION (replaced whole)
def test_a_write_at_positions_is_the_whole_write_bit_for_bit_and_snapshots_and_restore_still_hold(spill, frac):
    start = _params(0)
    start["w"][0, 0] = 0.0
    anchor, twin = Anchor(start, spill_dir=spill), Anchor(start, spill_dir=spill)
    v0, t0 = anchor.snapshot(), twin.snapshot()
    expected = {}
    for n, t in start.items():
        pos = _positions(t.numel(), 1, frac)
        if n == "w" and pos.numel():
            pos = torch.unique(torch.cat([pos, torch.tensor([0])]))  # 0.0 -> -0.0: equal floats, other bits
        at = anchor.values_at(n, pos)
        assert _bits_equal(at, t.reshape(-1)[pos])
        new_at = at - 0.25
        if n == "w" and pos.numel():
            new_at[0] = -0.0
        anchor.put_at(n, pos, new_at)
        whole = t.clone()
        whole.view(-1)[pos] = new_at
        twin[n] = whole
        expected[n] = whole
    v1 = anchor.snapshot()
    for n in start:
        assert _bits_equal(anchor[n], expected[n]) and _bits_equal(anchor[n], twin[n])
        assert _bits_equal(v0[n], start[n]) and _bits_equal(t0[n], start[n]) and _bits_equal(v1[n], expected[n])
    assert anchor.version == twin.version == 2
    anchor.restore(v0)
    assert all(_bits_equal(anchor[n], start[n]) for n in start)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_snapshot_read_at_positions_is_its_whole_read_there_and_says_where_later_writes_changed_it(tmp_path,
                                                                                                     where):
    """``Snapshot.values_at`` gives a version's values at positions bit for bit as its whole read has them, across
    sparse writes, overlapping ones and a whole replacement; ``changed_since`` names the positions written since
    (every one at which two versions differ) until a whole tensor is replaced."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 50, generator=g)
    anchor = Anchor({"w": w}, spill_dir=str(tmp_path) if where == "disk" else "")
    v0 = anchor.snapshot()
    first = torch.tensor([3, 17, 400, 1999], dtype=torch.int64)
    anchor.put_at("w", first, torch.tensor([1.0, -0.0, 2.0, 3.0]))
    v1 = anchor.snapshot()
    second = torch.tensor([17, 18, 1500], dtype=torch.int64)
    anchor.put_at("w", second, torch.tensor([5.0, 6.0, 7.0]))
    v2 = anchor.snapshot()
    probe = torch.unique(torch.cat([first, second, torch.randint(0, 2000, (50,), generator=g)]), sorted=True)
    for snap in (v0, v1, v2):
        whole = snap["w"].reshape(-1)
        assert torch.equal(snap.values_at("w", probe).view(torch.int32), whole[probe].view(torch.int32))
    assert torch.equal(v2.changed_since(v0, "w"), torch.unique(torch.cat([first, second])))
    assert torch.equal(v2.changed_since(v1, "w"), second)
    assert v2.changed_since(v2, "w").numel() == 0
    differ = (v0["w"] != v2["w"]).reshape(-1).nonzero().reshape(-1)
    assert set(differ.tolist()) <= set(v2.changed_since(v0, "w").tolist())
    assert v0.changed_since(v2, "w") is None  # the earlier one second
    anchor["w"] = w * 2  # replaced whole
    v3 = anchor.snapshot()
    assert v3.changed_since(v0, "w") is None and v3.changed_since(v2, "w") is None
    for snap in (v0, v1, v2, v3):
        assert torch.equal(snap.values_at("w", probe).view(torch.int32), snap["w"].reshape(-1)[probe].view(torch.int32))
