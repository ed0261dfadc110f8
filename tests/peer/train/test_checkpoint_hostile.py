"""The checkpoint loader turns every defect of a hostile file into UserInputError, before allocating."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.train.checkpoint import (
    load_checkpoint,
    open_checkpoint,
    optimizer_from_tensors,
    save_checkpoint,
)


def _header_swap(path: Path, change) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"model.w": torch.ones(2, 3)}, {"step": 1})
    return path


@pytest.mark.parametrize("dtype", ["U16", "F8_E4M3", "C64"])
def test_dtypes_torch_lacks_are_a_user_error(ckpt, dtype):
    _header_swap(ckpt, lambda h: h["model.w"].update(dtype=dtype))
    with pytest.raises(UserInputError, match=f"tensor 'model.w' has dtype '{dtype}'.*; delete it"):
        load_checkpoint(ckpt)


def test_overflowing_shape_is_a_user_error(ckpt):
    _header_swap(ckpt, lambda h: h["model.w"].update(shape=[2**62, 2**62]))
    with pytest.raises(UserInputError, match="shape must be at most 8 dims"):
        load_checkpoint(ckpt)


def test_deeply_nested_json_header_is_a_user_error(ckpt):
    _header_swap(ckpt, lambda h: h["__metadata__"].update(header="[" * 100_000))
    with pytest.raises(UserInputError, match=r"has a damaged header \(RecursionError\); delete it"):
        load_checkpoint(ckpt)


def test_huge_safetensors_header_length_is_refused_before_reading(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(UserInputError, match="1099511627776-byte safetensors header, over the"):
        load_checkpoint(path)


@pytest.mark.parametrize("pid", ["²", "00", "-1", "x"])
def test_non_canonical_optimizer_param_ids_are_a_user_error(pid):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UserInputError, match="not a parameter id"):
        optimizer_from_tensors(opt, {f"optim.{pid}.exp_avg": torch.ones(2)}, {"param_groups": []})
    with pytest.raises(UserInputError, match="not a parameter id"):
        optimizer_from_tensors(opt, {}, {"param_groups": [], "scalars": {pid: {"step": 1}}})


def test_malformed_optimizer_description_is_a_user_error():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    for desc in ({}, {"param_groups": "x"}, {"param_groups": [], "scalars": []}, {"param_groups": [None]}):
        with pytest.raises(UserInputError):
            optimizer_from_tensors(opt, {}, desc)


def test_unpadded_but_valid_file_written_by_safetensors_still_loads(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"x": torch.ones(3)}, str(path), metadata={"format": "hlbp-checkpoint", "version": "1", "header": "{}"})
    tensors, header = load_checkpoint(path)
    assert header == {} and torch.equal(tensors["x"], torch.ones(3))


@pytest.mark.parametrize("load", [load_checkpoint, open_checkpoint])
def test_flipped_tensor_bytes_fail_the_checksum(ckpt, load):
    data = bytearray(ckpt.read_bytes())
    data[-3] ^= 0x01  # inside model.w's bytes: the layout stays valid, the value changes
    ckpt.write_bytes(bytes(data))
    with pytest.raises(UserInputError, match="is damaged: its tensors do not match the checksum"):
        load(ckpt)


@pytest.mark.parametrize("load", [load_checkpoint, open_checkpoint])
def test_a_truncated_checkpoint_is_a_user_error(ckpt, load):
    ckpt.write_bytes(ckpt.read_bytes()[:-5])
    with pytest.raises(UserInputError, match="delete it"):
        load(ckpt)


def test_a_checkpoint_cut_short_after_it_was_opened_is_a_user_error_when_read(ckpt):
    tensors, _ = open_checkpoint(ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:-5])
    with pytest.raises(UserInputError, match="cannot be read .*delete it"):
        tensors["model.w"]


def test_a_checkpoint_written_a_tensor_at_a_time_loads_bit_for_bit(tmp_path):
    """save_checkpoint writes the safetensors file itself, one tensor at a time; safetensors' own reader and ours
    load every dtype a checkpoint holds exactly, empty tensors included, with the header and checksum."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "model.w": torch.randn(5, 7, generator=g),
        "model.half": torch.randn(3, generator=g).to(torch.bfloat16),
        "optim.0.step": torch.tensor(12.0),
        "optim.1.count": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, tensors, {"step": 12, "note": "x"})
    loaded, header = load_checkpoint(path)
    assert header == {"step": 12, "note": "x"} and sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    lazy, header = open_checkpoint(path)  # the same, each tensor read from the file when asked for
    assert header == {"step": 12, "note": "x"} and sorted(lazy) == sorted(tensors) and len(lazy) == len(tensors)
    for name, t in tensors.items():
        assert lazy.shape(name) == tuple(t.shape)
        assert lazy[name].dtype == t.dtype and torch.equal(lazy[name], t), name
    with pytest.raises(ValueError, match="complex"):
        save_checkpoint(tmp_path / "d.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)}, {})
    assert not (tmp_path / "d.safetensors").exists()


def test_a_save_reads_each_tensor_twice(tmp_path):
    """The layout and the checksum come from one read of each tensor, its bytes from a second: a tensor kept in a
    file (the round state on disk) is read from it twice a save, not three times."""
    reads: dict[str, int] = {}

    class Counted(dict):
        def __getitem__(self, name):
            reads[name] = reads.get(name, 0) + 1
            return super().__getitem__(name)

    tensors = Counted({"a": torch.randn(4, 3), "b": torch.arange(5)})
    save_checkpoint(tmp_path / "c.safetensors", tensors, {})
    assert reads == {"a": 2, "b": 2}
    loaded, _ = load_checkpoint(tmp_path / "c.safetensors")  # and its checksum is the tensors'
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])
