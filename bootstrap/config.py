"""The run config a bootstrap operator writes (TOML), and how it becomes a run manifest.

Every key is optional: with no file at all, the defaults describe a small run of the tiny preset on the built-in
corpus. Unknown keys are refused, because a misspelt hyperparameter that silently falls back to its default would
train a different run than the operator meant. Example::

    run_id = "demo"            # default: derived from the contents, so a restart keeps its run id
    seed = 0
    model = "tiny"
    n_stages = 2               # or: stages = [[0, 2], [2, 4]]
    data_recipe = "builtin"
    vocab_size = 8192          # when the bootstrap trains the tokenizer
    allowed_peers = []         # closed run: the peer ids that may contribute (empty: anyone may)
    [model_overrides]          # preset fields to change, e.g. n_layers = 8
    [hparams]                  # inner_steps, lr, batch_size, seq_len, k, beta, alpha, *_deadline_s, min_contributors,
                               # outer = "sparseloco" | "diloco", outer_lr, momentum (DiLoCo),
                               # aggregation = "selectors" | "mean", weighting = "equal" | "tokens", clip_median,
                               # small_tensors = "topk" | "dense" (SparseLoCo: 1-D and sub-chunk tensors whole),
                               # overlap = "none" | "naive" | "eager" (rounds beside the next inner phase;
                               # default eager for sparseloco, none for diloco, which refuses overlap),
                               # max_contribution_ratio, max_update_ratio, max_loss_jump (the round guard's bounds),
                               # schedule_steps (the inner lr schedule's length on every peer; 0: 1000 rounds of H)
    [codec]                    # name = "dense" | "subspace-a" | "subspace-a-drift" | "subspace-b", k = 4, dtype = "fp32"
    [placement]                # replica_min_throughput = 2000.0, max_peers_per_stage = 1
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from hlbp.peer.common.errors import UserInputError
from hlbp.protocol import ProtocolError
from hlbp.protocol.manifest import (
    PROTOCOL_VERSION,
    CodecSpec,
    Hyperparameters,
    Manifest,
    Placement,
    check_run_id,
)

_TOP_KEYS = {"run_id", "seed", "model", "n_stages", "stages", "data_recipe", "vocab_size", "model_overrides",
             "hparams", "codec", "placement", "allowed_peers"}
TOKENIZER_ARTIFACT = "tokenizer.json"


@dataclass
class RunConfig:
    """What the operator chose; :func:`build_manifest` adds the tokenizer and the partition."""

    run_id: str | None = None  # None: "hlbp-" + a hash of everything else, stable across restarts
    seed: int = 0  # seeds init, data order and subspace bases on every peer
    model: str = "tiny"  # preset name
    n_stages: int = 2  # pipeline stages, split so the slowest (head included) is fastest, unless stages is given
    stages: list[list[int]] | None = None  # explicit [start, end) layer ranges
    data_recipe: str = "builtin"  # corpus spec for hlbp.peer.data.streams
    vocab_size: int = 8192  # BPE size when the bootstrap trains the tokenizer
    model_overrides: dict[str, Any] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)  # fields of records.Hyperparameters
    codec: dict[str, Any] = field(default_factory=dict)  # fields of manifest.CodecSpec
    placement: dict[str, Any] = field(default_factory=dict)  # fields of records.Placement
    allowed_peers: list[str] = field(default_factory=list)  # closed run: who may contribute (empty: anyone)


def load_run_config(path: Path | None) -> RunConfig:
    """Parse ``path`` (TOML) or return the defaults; every problem is a UserInputError naming the file."""
    if path is None:
        return RunConfig()
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserInputError(f"cannot read run config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UserInputError(f"run config {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserInputError(f"run config {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise UserInputError(f"run config {path}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(_TOP_KEYS))}")
    for section, cls in (("hparams", Hyperparameters), ("codec", CodecSpec), ("placement", Placement)):
        value = raw.get(section, {})
        if not isinstance(value, dict):
            raise UserInputError(f"run config {path}: [{section}] must be a table")
        bad = sorted(set(value) - set(cls.__dataclass_fields__))
        if bad:
            raise UserInputError(f"run config {path}: unknown [{section}] keys {', '.join(bad)}")
    try:
        return RunConfig(**raw)
    except TypeError as exc:
        raise UserInputError(f"run config {path}: {exc}") from None


def _partition(cfg: RunConfig) -> list[list[int]]:
    """The operator's ``stages``, or the split whose slowest stage is fastest at the run's sequence length (a
    ``seq_len`` that is not a sane integer is left for the manifest's checks to refuse)."""
    if cfg.stages is not None:
        return cfg.stages
    from hlbp.peer.model.decoder import balanced_partition, preset

    config = preset(cfg.model, **cfg.model_overrides)
    seq_len = cfg.hparams.get("seq_len") if isinstance(cfg.hparams, dict) else None
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 1 <= seq_len <= 1 << 20:
        seq_len = Hyperparameters.seq_len
    return [list(s) for s in balanced_partition(config, cfg.n_stages, seq_len)]


def build_manifest(cfg: RunConfig, tokenizer: bytes, issued_at: float) -> Manifest:
    """The manifest of this run, validated by the same checks peers apply when they read it."""
    tok_hash = hashlib.sha256(tokenizer).hexdigest()
    body: dict[str, Any] = {
        "proto": PROTOCOL_VERSION,
        "issued_at": 0.0,
        "seed": cfg.seed,
        "model": cfg.model,
        "model_overrides": cfg.model_overrides,
        "tokenizer_hash": tok_hash,
        "data_recipe": cfg.data_recipe,
        "hparams": cfg.hparams,
        "stages": _partition(cfg),
        "codec": cfg.codec,
        "placement": cfg.placement,
        "artifacts": [{"name": TOKENIZER_ARTIFACT, "sha256": tok_hash, "size": len(tokenizer)}],
        "allowed_peers": sorted(set(cfg.allowed_peers)) if isinstance(cfg.allowed_peers, list) else cfg.allowed_peers,
    }
    try:
        run_id = check_run_id(cfg.run_id) if cfg.run_id is not None else None
        # The default id hashes the normalized content, so the same config and tokenizer give the same run.
        probe = Manifest.from_body({**body, "run": run_id or "unnamed"})
        if run_id is None:
            normalized = msgpack.packb({**probe.to_body(), "run": ""}, use_bin_type=True)
            run_id = "hlbp-" + hashlib.sha256(normalized).hexdigest()[:10]
        return Manifest.from_body({**probe.to_body(), "run": run_id, "issued_at": issued_at})
    except ProtocolError as exc:
        raise UserInputError(f"run config: {exc}") from None

