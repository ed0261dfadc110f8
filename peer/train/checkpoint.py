"""Atomic checkpoints: one safetensors file with tensors plus an explicit JSON header in its metadata.

No pickle anywhere: a checkpoint may come from another machine, so loading treats it as untrusted and turns
any defect into a :class:`UserInputError` that names the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hlbp.peer.common.errors import UserInputError

FORMAT = "hlbp-checkpoint"
FORMAT_VERSION = 1


def save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    """Save tensors and a JSON-serialisable header atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "version": str(FORMAT_VERSION), "header": json.dumps(header, sort_keys=True)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a checkpoint written by :func:`save_checkpoint`; raises :class:`UserInputError` if it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"checkpoint {path} does not exist; check the path or start without --resume")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserInputError(f"checkpoint {path} is not a readable safetensors file ({exc}); delete it") from None
    if meta.get("format") != FORMAT:
        raise UserInputError(f"{path} is not an hlbp checkpoint (format={meta.get('format')!r})")
    if meta.get("version") != str(FORMAT_VERSION):
        raise UserInputError(f"checkpoint {path} has version {meta.get('version')}, this hlbp reads {FORMAT_VERSION}")
    try:
        header = json.loads(meta["header"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise UserInputError(f"checkpoint {path} has a damaged header ({exc}); delete it") from None
    if not isinstance(header, dict):
        raise UserInputError(f"checkpoint {path} has a damaged header; delete it")
    return tensors, header


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
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], desc: dict, prefix: str = "optim."
) -> None:
    """Inverse of :func:`optimizer_to_tensors`; a mismatch with the optimizer raises :class:`UserInputError`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith(prefix):
            continue
        pid, _, key = name[len(prefix):].partition(".")
        state.setdefault(int(pid), {})[key] = value
    for pid, extra in desc.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": desc["param_groups"]})
    except (KeyError, ValueError, TypeError) as exc:
        raise UserInputError(f"checkpoint optimizer state does not match this model ({exc})") from None
