"""Atomic checkpoints: one safetensors file with tensors plus an explicit JSON header in its metadata.

No pickle anywhere: a checkpoint may come from another machine, so loading treats it as untrusted and turns
any defect into a :class:`UserInputError` that names the file. The safetensors header is validated with
:func:`hlbp.protocol.dense.read_header` (dtypes torch loads, shapes, offsets that tile the file) before safetensors
or torch allocate anything, and the JSON header is size-bounded and nesting-bounded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import atomic_path
from hlbp.peer.common.spill import bytes_of, stream_of
from hlbp.protocol import ProtocolError
from hlbp.protocol.dense import read_header

MAX_HEADER_BYTES = 64 << 20
"""Largest safetensors header accepted: about a million tensors' worth."""
MAX_JSON_BYTES = 16 << 20
"""Largest hlbp JSON header (param groups and optimizer scalars) accepted."""

FORMAT = "hlbp-checkpoint"
FORMAT_VERSION = 1


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: what a checkpoint's tensors were
    when saved. safetensors checks a file's layout, not its contents, so flipped bytes on disk would otherwise load
    as silently wrong parameters."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        _hash_into(h, name, tensors[name].detach().contiguous().cpu())
    return h.hexdigest()


def _hash_into(h: Any, name: str, t: torch.Tensor) -> None:
    """Add one host tensor to a :func:`tensors_digest` in progress (tensors go in name order)."""
    _hash_head(h, name, t.dtype, tuple(t.shape))
    h.update(bytes_of(t))


def _hash_head(h: Any, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """What a :func:`tensors_digest` takes of a tensor before its bytes."""
    h.update(f"{name}\0{dtype}\0{shape}\0".encode())


_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
"""safetensors' name of each dtype a checkpoint may hold."""


def save_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor], header: dict[str, Any]) -> None:
    """Save tensors and a JSON-serialisable header atomically (temporary file, fsync, rename), with the tensors'
    checksum (:func:`tensors_digest`) in the metadata.

    The safetensors file is written one tensor at a time, each read twice (its layout and checksum, then its
    bytes): a tensor kept in a file is read a block at a time (:func:`~hlbp.peer.common.spill.stream_of`), and a
    tensor on a GPU is copied to the host only while it is hashed and while it is written, so saving a model and its AdamW state never holds them on the host whole
    (12 bytes per parameter beside a GPU; docs/design.md, "Memory per parameter")."""
    names = sorted(tensors)
    entries: dict[str, Any] = {}
    offset = 0
    digest = hashlib.sha256()
    for name in names:  # the layout and the checksum in one read of each tensor; the write below is the second
        streamed = stream_of(tensors, name)
        if streamed.dtype not in _ST_DTYPE:
            raise ValueError(f"tensor {name} has dtype {streamed.dtype}, which a checkpoint does not hold")
        size = math.prod(streamed.shape) * streamed.dtype.itemsize
        entries[name] = {"dtype": _ST_DTYPE[streamed.dtype], "shape": list(streamed.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
        _hash_head(digest, name, streamed.dtype, streamed.shape)
        for block in streamed.blocks:
            digest.update(bytes_of(block))
    entries["__metadata__"] = {"format": FORMAT, "version": str(FORMAT_VERSION),
                               "header": json.dumps(header, sort_keys=True), "sha256": digest.hexdigest()}
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in names:
            for block in stream_of(tensors, name).blocks:
                f.write(bytes_of(block))


def _read_prefix(path: Path) -> bytes:
    """The 8-byte length and the safetensors header of ``path``, read without mapping the tensor data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise UserInputError(f"checkpoint {path} has a {n}-byte safetensors header, over the "
                                 f"{MAX_HEADER_BYTES} limit; delete it")
        return head + f.read(n)


def _metadata(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The safetensors metadata and the parsed header of the checkpoint ``path``, read without its tensors;
    :class:`UserInputError` when it is not one this hlbp reads."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"checkpoint {path} does not exist; check the path or start without --resume")
    try:
        prefix = _read_prefix(path)
        size = path.stat().st_size
        read_header(prefix, MAX_HEADER_BYTES, what=f"checkpoint {path}", total_size=size)
    except ProtocolError as exc:
        raise UserInputError(f"{exc}; delete it") from None
    except OSError as exc:
        raise UserInputError(f"checkpoint {path} cannot be read ({exc})") from None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        raise UserInputError(f"checkpoint {path} is not a readable safetensors file ({exc}); delete it") from None
    if meta.get("format") != FORMAT:
        raise UserInputError(f"{path} is not an hlbp checkpoint (format={str(meta.get('format'))[:40]!r})")
    if meta.get("version") != str(FORMAT_VERSION):
        raise UserInputError(f"checkpoint {path} has version {str(meta.get('version'))[:40]}, this hlbp reads "
                             f"{FORMAT_VERSION}")
    raw = meta.get("header")
    if not isinstance(raw, str) or len(raw) > MAX_JSON_BYTES:
        raise UserInputError(f"checkpoint {path} has a missing or oversized header; delete it")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UserInputError(f"checkpoint {path} has a damaged header ({type(exc).__name__}); delete it") from None
    if not isinstance(header, dict):
        raise UserInputError(f"checkpoint {path} has a damaged header; delete it")
    return meta, header


_TORCH_DTYPE = {name: dtype for dtype, name in _ST_DTYPE.items()}


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors, each read from the file when it is asked for (plain reads into a fresh tensor, no
    memory mapping), so a caller that puts each in its place and lets it go holds one tensor of the file at a time.
    Loading a whole checkpoint held all of it beside the state it was restoring: a resumed replica peaked at about
    twice its state's bytes, and beside a GPU the host held the whole model and AdamW state (docs/design.md,
    "Memory per parameter"). Made by :func:`open_checkpoint`, which has checked the file's layout and digest."""

    def __init__(self, path: Path, entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]]) -> None:
        self.path = Path(path)
        self._entries = dict(entries)  # name -> (dtype, shape, offset of its bytes in the file)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it."""
        return self._entries[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, offset = self._entries[name]
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            view = out.reshape(-1).view(torch.uint8).numpy()
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    if f.readinto(view) != view.nbytes:
                        raise OSError("the file ended early")
            except OSError as exc:
                raise UserInputError(f"checkpoint {self.path} cannot be read ({exc}); delete it") from None
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


def open_checkpoint(path: Path) -> tuple[CheckpointTensors, dict[str, Any]]:
    """:func:`load_checkpoint`'s checks (layout, format, header, digest) with the tensors left in the file: the
    digest is computed one tensor at a time, and the mapping returned reads each tensor when it is asked for
    (:class:`CheckpointTensors`). For a peer resuming its state, which must not hold the file and the state whole
    at once."""
    path = Path(path)
    meta, header = _metadata(path)
    prefix = _read_prefix(path)
    try:  # the layout these reads follow, checked from these very bytes: dtypes, shapes, offsets that tile the file
        read_header(prefix, MAX_HEADER_BYTES, what=f"checkpoint {path}", total_size=path.stat().st_size)
    except ProtocolError as exc:
        raise UserInputError(f"{exc}; delete it") from None
    except OSError as exc:
        raise UserInputError(f"checkpoint {path} cannot be read ({exc})") from None
    start = len(prefix)
    layout = json.loads(prefix[8:].decode("utf-8"))
    layout.pop("__metadata__", None)
    entries = {}
    for name, entry in layout.items():
        if entry["dtype"] not in _TORCH_DTYPE:
            raise UserInputError(f"checkpoint {path} holds tensor {name[:60]!r} of dtype {entry['dtype']!r}, which "
                                 "an hlbp checkpoint does not; delete it")
        entries[name] = (_TORCH_DTYPE[entry["dtype"]], tuple(entry["shape"]), start + entry["data_offsets"][0])
    tensors = CheckpointTensors(path, entries)
    digest = meta.get("sha256")  # absent in checkpoints written before it was kept
    if digest is not None and digest != tensors_digest(tensors):
        raise UserInputError(f"checkpoint {path} is damaged: its tensors do not match the checksum saved with them; "
                             "delete it")
    return tensors, header


def checkpoint_header(path: Path) -> dict[str, Any]:
    """The JSON header of a checkpoint, without loading its tensors (which round a checkpoint is of)."""
    return _metadata(path)[1]


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a checkpoint written by :func:`save_checkpoint`; raises :class:`UserInputError` if it is unusable."""
    path = Path(path)
    meta, header = _metadata(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        raise UserInputError(f"checkpoint {path} is not a readable safetensors file ({exc}); delete it") from None
    digest = meta.get("sha256")  # absent in checkpoints written before it was kept
    if digest is not None and digest != tensors_digest(tensors):
        raise UserInputError(f"checkpoint {path} is damaged: its tensors do not match the checksum saved with them; "
                             "delete it")
    return tensors, header


def load_module(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Copy the tensors named ``prefix`` + each name of ``module``'s state dict into it, one at a time, as
    ``load_state_dict(strict=True)`` would: the names and shapes must be exactly the module's (checked before
    anything is copied, from :meth:`CheckpointTensors.shape` where the tensors are still in the file), else
    :class:`UserInputError`."""
    own = module.state_dict(keep_vars=True)
    names = [n[len(prefix):] for n in tensors if n.startswith(prefix)]
    missing, unexpected = sorted(set(own) - set(names)), sorted(set(names) - set(own))
    if missing or unexpected:
        raise UserInputError(f"checkpoint does not match this model: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}")
    shape = tensors.shape if isinstance(tensors, CheckpointTensors) else (lambda n: tuple(tensors[n].shape))
    wrong = [n for n in names if tuple(shape(prefix + n)) != tuple(own[n].shape)]
    if wrong:
        raise UserInputError(f"checkpoint does not match this model: {wrong[0]} has shape "
                             f"{tuple(shape(prefix + wrong[0]))}, the model's is {tuple(own[wrong[0]].shape)}")
    with torch.no_grad():
        for n in names:
            own[n].copy_(tensors[prefix + n])


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, prefix: str = "optim.") -> tuple[dict, dict]:
    """Flatten an optimizer's state into named tensors plus a JSON-able description of its param groups."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{prefix}{pid}.{key}"] = value
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], desc: dict, prefix: str = "optim."
) -> None:
    """Inverse of :func:`optimizer_to_tensors`; a mismatch with the optimizer raises :class:`UserInputError`.
    Each tensor is read (``tensors`` may read it from the file, :class:`CheckpointTensors`) and moved to its
    parameter's device before the next is read, so the host never holds the whole state beside a GPU."""
    state: dict[int, dict[str, Any]] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        for name in tensors:
            if not name.startswith(prefix):
                continue
            pid, _, key = name[len(prefix):].partition(".")
            index = _param_id(pid)
            value = tensors[name]
            state.setdefault(index, {})[key] = value.to(params[index].device) if index < len(params) else value
        scalars = desc.get("scalars", {})
        if not isinstance(scalars, dict):
            raise UserInputError("checkpoint optimizer scalars must be a map")
        for pid, extra in scalars.items():
            if not isinstance(extra, dict):
                raise UserInputError("checkpoint optimizer scalars must map parameter ids to maps")
            state.setdefault(_param_id(pid), {}).update(extra)
        optimizer.load_state_dict({"state": state, "param_groups": desc["param_groups"]})
    except UserInputError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        raise UserInputError(f"checkpoint optimizer state does not match this model ({str(exc)[:200]})") from None


def _param_id(text: str) -> int:
    """A canonical decimal parameter id ("0", "12"; not "00", "+1" or "²")."""
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or str(int(text)) != text:
        raise UserInputError(f"checkpoint optimizer state names parameter {str(text)[:20]!r}, not a parameter id")
    return int(text)
