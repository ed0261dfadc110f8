"""A replica's checkpoint: the global parameters (the anchor), each held shard's outer optimizer state, the round
and the inner trainer's state, in one atomic file (:mod:`hlbp.peer.train.checkpoint`).

Functions over that state, not a part of the round loop: the loop decides when to save and what to do with what
was loaded; these decide what a checkpoint holds and whether one is this run's and usable.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import remove_stale_temps
from hlbp.peer.common.spill import Streamed, stream_of
from hlbp.peer.rounds.state import ReplicaState
from hlbp.peer.train.checkpoint import open_checkpoint, save_checkpoint
from hlbp.protocol.roundwire import MAX_RECORD_BYTES

logger = logging.getLogger(__name__)

ANCHOR = "anchor."


def _outer_prefix(shard: int) -> str:
    return f"outer{shard}."


@dataclass
class SavedReplica:
    """What a checkpoint of this run held: the anchor, each held shard's outer optimizer state, the next round to
    run, and the raw tensors and header the inner trainer restores itself from."""

    anchor: Mapping[str, torch.Tensor]  # each read from the file when asked for (CheckpointTensors)
    outers: dict[int, Mapping[str, torch.Tensor]]
    round: int
    tensors: Mapping[str, torch.Tensor]
    header: dict[str, Any]


def encode_evidence(evidence: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, str]]:
    """A state's evidence (:attr:`ReplicaState.evidence`) as JSON for the checkpoint header (base64 values)."""
    return {key: {signer: base64.b64encode(v).decode() for signer, v in by.items()} for key, by in evidence.items()}


def decode_evidence(raw: Any) -> dict[str, dict[str, bytes]]:
    """A checkpoint header's evidence, or nothing when it is missing or malformed (the file is as hostile as the
    network: sizes are checked before anything is decoded, and every record is verified again by its readers)."""
    if not isinstance(raw, dict) or len(raw) > 2:
        return {}
    out: dict[str, dict[str, bytes]] = {}
    for key, by in raw.items():
        if not isinstance(key, str) or len(key) > 512 or not isinstance(by, dict) or len(by) > 1:
            return {}
        for signer, text in by.items():
            if (not isinstance(signer, str) or len(signer) > 128 or not isinstance(text, str)
                    or len(text) > 2 * MAX_RECORD_BYTES):
                return {}
            try:
                out.setdefault(key, {})[signer] = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                return {}
    return out


class _Joined(Mapping[str, torch.Tensor]):
    """Several mappings of tensors under one, each under its prefix, each tensor read when the writer asks for it:
    state kept in a file (a spilled error-feedback buffer) is never read whole to be saved."""

    def __init__(self, parts: Sequence[tuple[str, Mapping[str, torch.Tensor]]]) -> None:
        self._where = {prefix + n: (part, n) for prefix, part in parts for n in part}

    def __getitem__(self, key: str) -> torch.Tensor:
        part, n = self._where[key]
        return part[n]

    def stream(self, key: str) -> Streamed:
        """Tensor ``key`` a block at a time where its mapping can hand it out so (a spilled anchor or buffer)."""
        part, n = self._where[key]
        return stream_of(part, n)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def save_replica(path: Path, anchor: Mapping[str, torch.Tensor], outers: Mapping[int, Mapping[str, torch.Tensor]],
                 trainer: Any, round_: int, in_sync: bool, run_id: str,
                 evidence: Mapping[str, Mapping[str, bytes]] | None = None,
                 standing: Mapping[str, Any] | None = None, bans: Mapping[str, Any] | None = None,
                 window: float | None = None) -> bool:
    """Save the checkpoint, unless the anchor holds a non-finite value: a poisoned state is never stored as current
    (the previous checkpoint stays, and a restart syncs from peers). Returns whether it was saved."""
    if not all(bool(torch.isfinite(block).all()) for name in anchor for block in stream_of(anchor, name).blocks):
        logger.error("not saving the checkpoint: the global parameters hold a non-finite value")
        return False
    own, header = trainer.state_tensors()
    tensors = _Joined([("", own), (ANCHOR, anchor), *((_outer_prefix(s), state) for s, state in outers.items())])
    save_checkpoint(path, tensors, {**header, "round": round_, "in_sync": in_sync, "run": run_id,
                                    "evidence": encode_evidence(evidence or {}), "standing": standing or {},
                                    "bans": bans or {}, "window": window})
    return True


def load_replica(path: Path, run_id: str, shapes: Mapping[str, tuple[int, ...]],
                 shards: list[int]) -> SavedReplica | None:
    """This run's checkpoint at ``path``, or None when there is none, it is another run's, or its anchor holds a
    non-finite value. ``shapes``: the anchor's parameter shapes; ``shards``: the held shards whose outer state to
    read. Raises :class:`UserInputError` when the file is not a usable checkpoint of this run's parameters."""
    if remove_stale_temps(path):
        logger.info("removed the temporary files of an interrupted checkpoint save")
    if not path.exists():
        return None
    tensors, header = open_checkpoint(path)  # checked, its tensors left in the file until each is asked for
    if header.get("run") != run_id:
        return None
    anchor = _Prefixed(tensors, ANCHOR)
    if not all(bool(torch.isfinite(anchor[n]).all()) for n in anchor):
        logger.warning("ignoring checkpoint %s: its global parameters hold a non-finite value", path)
        return None
    round_ = header.get("round")
    if ({n: tensors.shape(ANCHOR + n) for n in anchor} != {n: tuple(s) for n, s in shapes.items()}
            or isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0):
        raise UserInputError(f"checkpoint {path} does not hold this run's global parameters and "
                             "round; move it away (the peer then syncs from the others)")
    outers = {s: _Prefixed(tensors, _outer_prefix(s)) for s in shards}
    return SavedReplica(anchor, outers, round_, tensors, header)


class _Prefixed(Mapping[str, torch.Tensor]):
    """The tensors of ``tensors`` whose names start with ``prefix``, by the rest of their names, each read when
    asked for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._tensors, self._prefix = tensors, prefix
        self._names = [n[len(prefix):] for n in tensors if n.startswith(prefix)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._tensors[self._prefix + name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Checkpoints:
    """One round loop's checkpoint file (``path``; None: none kept): saved every ``every_s`` seconds and on exit,
    resumed at start."""

    def __init__(self, path: Path | None, every_s: float, trainer: Any, run_id: str) -> None:
        self.path, self.every_s, self.trainer, self.run_id = path, every_s, trainer, run_id
        self._saved_at = time.monotonic()

    def save(self, state: ReplicaState) -> None:
        """Save ``state`` now (:func:`save_replica`: never a non-finite one)."""
        self._saved_at = time.monotonic()
        if self.path is not None:
            save_replica(self.path, state.anchor, {s: o.state_tensors() for s, o in state.outers.items()},
                         self.trainer, state.round, state.in_sync, self.run_id, state.evidence,
                         state.standing.to_json(), state.bans.to_json(), state.window.to_json())

    def save_if_due(self, state: ReplicaState) -> None:
        """Save when ``every_s`` has passed (a 1B model's checkpoint is over 20 GB); exits always save."""
        if time.monotonic() - self._saved_at >= self.every_s:
            self.save(state)

    def resume(self, state: ReplicaState) -> bool:
        """Load this run's checkpoint into ``state`` and the trainer, if there is one; the caller then checks it is
        current. A checkpoint that cannot be used (damaged, truncated, another model's) is moved aside, named in one
        warning, and the round loop syncs from its peers instead: under a restart policy a peer must not crash-loop
        on its own file."""
        if self.path is None:
            return False
        try:
            saved = load_replica(self.path, self.run_id, {n: tuple(t.shape) for n, t in state.anchor.items()},
                                 list(state.outers))
        except UserInputError as exc:
            aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
            self.path.replace(aside)
            logger.warning("%s; moved it to %s and starting without it (the peer syncs from the others)", exc,
                           aside.name)
            return False
        if saved is None:
            return False
        self.trainer.load_state(saved.tensors, saved.header)
        # the old one goes first: the checkpoint's replaces it one tensor at a time, kept where the old one was
        state.anchor = anchor = state.anchor.emptied()
        anchor.update((n, saved.anchor[n].float()) for n in saved.anchor)
        for s, o in state.outers.items():
            o.load_state(saved.outers[s])
        state.round = saved.round
        # a state saved out of sync (a round whose apply failed, a stop before the resync ended) is not the round's
        # agreed one: the restarted peer neither serves it nor votes with it, and syncs
        state.in_sync = saved.header.get("in_sync", True) is not False
        state.evidence = decode_evidence(saved.header.get("evidence"))
        state.standing.load_json(saved.header.get("standing"), saved.round - 1)
        state.bans.load_json(saved.header.get("bans"))
        state.window.load_json(saved.header.get("window"))
        return True
