"""Tensors kept in a file (hlbp.peer.common.spill): every dtype and shape comes back bit for bit, slots are reused,
reads are copies, and the bytes stored are not the process's memory."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

from hlbp.peer.common import spill
from hlbp.peer.common.memory import current_host_bytes, trim
from hlbp.peer.common.spill import NoRoomError, SpilledTensors, require_room


@pytest.mark.parametrize("value", [
    torch.randn(3, 5),
    torch.randn(7).bfloat16(),
    torch.tensor(2.5),
    torch.empty(0, 4),
    torch.randn(4, 6)[:, ::2],  # not contiguous
    torch.tensor([float("nan"), -0.0, float("inf")]),
    torch.arange(10, dtype=torch.int64).reshape(2, 5),
], ids=["fp32", "bf16", "scalar", "empty", "strided", "specials", "int64"])
def test_a_tensor_comes_back_bit_for_bit(tmp_path, value):
    store = SpilledTensors(tmp_path)
    store["x"] = value
    got = store["x"]
    assert got.dtype == value.dtype and got.shape == value.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8))


def test_a_read_is_a_copy_and_a_write_is_what_changes_the_store(tmp_path):
    store = SpilledTensors(tmp_path)
    store["w"] = torch.zeros(4)
    store["w"].add_(1)  # changes the copy only
    assert torch.equal(store["w"], torch.zeros(4))
    store["w"] = store["w"].add_(1)
    assert torch.equal(store["w"], torch.ones(4))


def test_slots_are_reused_so_the_file_holds_what_is_stored(tmp_path):
    store = SpilledTensors(tmp_path)
    for _ in range(5):  # a round's rewrites of every parameter
        for i in range(3):
            store[f"p{i}"] = torch.randn(100, 10)
    size = store.file_bytes()
    assert size == 3 * 4000 == store.nbytes()
    del store["p1"]
    store["q"] = torch.randn(1000)  # the freed slot's size: it goes there
    assert store.file_bytes() == size
    store["q"] = torch.randn(10)  # resized: a new slot; the old one is free for the next of its size
    assert sorted(store) == ["p0", "p2", "q"] and store.nbytes() == 2 * 4000 + 40
    store.clear()
    assert len(store) == 0 and store.file_bytes() == 0
    with pytest.raises(KeyError):
        store["p0"]


def test_the_stored_bytes_are_not_the_processes_memory(tmp_path):
    """Storing 256 MiB one 4 MiB tensor at a time leaves the resident set where it was; a dict of the same
    tensors grows it by their size."""
    n, shape = 64, (1024, 1024)
    mib = 1 << 20

    def grown(store) -> float:
        gc.collect()
        trim()
        before = current_host_bytes()
        for i in range(n):
            store[f"t{i}"] = torch.full(shape, float(i))
        gc.collect()
        trim()
        return (current_host_bytes() - before) / mib

    spilled = SpilledTensors(tmp_path)
    assert grown(spilled) < 32
    assert torch.equal(spilled["t7"], torch.full(shape, 7.0))
    held: dict[str, torch.Tensor] = {}
    assert grown(held) > 200


def test_a_full_disk_is_a_typed_error_where_the_store_grows_and_never_at_a_write_into_a_slot(small_disk):
    store = SpilledTensors(small_disk)
    store["a"] = torch.zeros(160 * 1024)  # 640 KiB: taken when the slot is made
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"x" * free)  # someone else takes the rest of the disk
    for _ in range(3):
        store["a"] = torch.randn(160 * 1024)  # into the slot it has: no new space needed, never ENOSPC
    kept = store["a"]
    with pytest.raises(NoRoomError, match="--state-in-memory") as info:
        store["b"] = torch.zeros(64 * 1024)
    assert str(small_disk) in str(info.value)
    assert sorted(store) == ["a"] and torch.equal(store["a"], kept)  # what was stored is intact
    filler.unlink()
    store["b"] = torch.ones(64 * 1024)  # room again: the store goes on
    assert torch.equal(store["b"], torch.ones(64 * 1024)) and torch.equal(store["a"], kept)


def test_require_room_refuses_what_the_disk_cannot_hold(small_disk):
    require_room(small_disk, 512 * 1024, "the round state")
    with pytest.raises(NoRoomError, match=r"the round state needs 2 MiB under .*--state-in-memory"):
        require_room(small_disk, 2 * 2**20, "the round state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_scatter_touch_the_positions_only_a_block_at_a_time(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(spill, "BLOCK_BYTES", 64)  # blocks of 16 or 32 values: the positions span many
    store = SpilledTensors(tmp_path)
    value = torch.randn(37, 11).to(dtype)
    store["t"] = value
    pos = torch.tensor([0, 1, 15, 16, 17, 63, 64, 200, 406], dtype=torch.int64)
    assert torch.equal(store.gather("t", pos), value.reshape(-1)[pos])
    new = torch.arange(pos.numel()).to(dtype)
    store.scatter("t", pos, new)
    expected = value.clone()
    expected.view(-1)[pos] = new
    assert torch.equal(store["t"], expected)
    assert store.meta("t") == (dtype, (37, 11))
    assert store.gather("t", pos[:0]).numel() == 0
    for bad in (torch.tensor([3, 2]), torch.tensor([4, 4]), torch.tensor([-1]), torch.tensor([407])):
        with pytest.raises(ValueError):
            store.gather("t", bad)
    with pytest.raises(ValueError):
        store.scatter("t", pos, new.float() if dtype != torch.float32 else new.double())
    assert torch.equal(store["t"], expected)  # a refused scatter wrote nothing


@pytest.mark.parametrize("value", [
    torch.randn(37, 11),
    torch.randn(101).bfloat16(),
    torch.tensor([True, False, True]),
    torch.tensor(2.5),
    torch.empty(0, 4),
], ids=["fp32", "bf16", "bool", "scalar", "empty"])
def test_a_stream_hands_out_the_tensors_bytes_in_order_a_block_at_a_time(tmp_path, monkeypatch, value):
    monkeypatch.setattr(spill, "BLOCK_BYTES", 64)  # blocks of 16 fp32 or 32 bf16 values
    store = SpilledTensors(tmp_path)
    store["t"] = value
    streamed = store.stream("t")
    assert (streamed.dtype, streamed.shape) == (value.dtype, tuple(value.shape))
    parts = [block.view(torch.uint8).clone() for block in streamed.blocks]
    assert all(p.numel() <= 64 for p in parts)
    want = value.reshape(-1).view(torch.uint8)
    assert torch.equal(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8), want)
    assert len(parts) == -(-want.numel() // 64)
    # a tensor held in memory is one block; either way stream_of says its dtype and shape
    whole = spill.stream_of({"t": value}, "t")
    assert (whole.dtype, whole.shape) == (value.dtype, tuple(value.shape))
    assert torch.equal(torch.cat([b.reshape(-1).view(torch.uint8) for b in whole.blocks]), want)


def test_a_tensor_rewritten_while_streamed_is_refused_not_mixed(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "BLOCK_BYTES", 64)
    store = SpilledTensors(tmp_path)
    store["t"] = torch.zeros(64)
    blocks = store.stream("t").blocks
    next(blocks)
    store["t"] = torch.ones(64)  # same size: the same slot, rewritten under the reader
    with pytest.raises(spill.ChangedWhileStreamed):
        next(blocks)
