"""The run manifest, published by the bootstrap: what model, tokenizer, data, hyperparameters and stage partition
every peer of the run uses; its schema, msgpack codec with size limits, and signature. The other control-plane
record, a peer's announcement, is in :mod:`hlbp.protocol.announcement`.

An envelope (:mod:`hlbp.protocol.identity`) is bound to its sender: the signer is an Ed25519 libp2p peer id, which
embeds the public key itself (an "identity" multihash), so the same key that p2pd uses for the peer's transport
identity signs its records and a verifier needs nothing but the peer id. Readers ignore unknown body fields, so records can grow new fields without
breaking older peers. Everything here is a pure function over bytes: no network, no clock (callers pass ``now``),
no global state. Every decoder raises :class:`ProtocolError` and nothing else on bad input.

Field checks live in :mod:`hlbp.protocol.fields`, data-plane request and response headers in
:mod:`hlbp.protocol.frames`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hlbp.protocol.errors import ProtocolError
from hlbp.protocol.fields import _bool, _float, _int, _str, _str_list
from hlbp.protocol.identity import Identity, open_envelope, public_key_from_peer_id, seal

MAX_COMMITTEE = 32  # committee seats a manifest may ask for (hlbp.peer.rounds.committee)

PROTOCOL_VERSION = 3  # bumped when peers of different versions can no longer train together
KIND_MANIFEST = "manifest"

MAX_MANIFEST_BYTES = 16 * 1024  # a manifest is a few hundred bytes; the cap bounds what a forger can make us parse
MAX_HEADER_BYTES = 4 * 1024  # a data-plane request or response header
MAX_ARTIFACT_BYTES = 256 * 1024 * 1024  # largest artifact a fetcher accepts unless the manifest says less
MAX_PROBE_BYTES = 64 * 1024 * 1024  # largest bandwidth probe a server sends
MAX_ALLOWED_PEERS = 256  # a closed run's allow-list; each id is about 52 bytes, and the manifest stays under 16 KiB

MANIFEST_KEY = "hlbp:manifest"  # DHT key; subkey is the signer's peer id

SMALL_TENSOR_RULES = ("topk", "dense")
"""How a run compresses small tensors: the run's k like any other, or every value (see
:func:`hlbp.protocol.sparse.tensor_k`)."""


RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch, like every pattern here
SHA256_RE = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------------------------
# Field checks: every field read from a body goes through one of these
# ---------------------------------------------------------------------------------------------------------------

def check_run_id(run_id: str) -> str:
    """Run ids name DHT keys and directories, so they are short and use a safe alphabet."""
    return _str({"run_id": run_id}, "run_id", 64, pattern=RUN_ID_RE)


def check_sha256(digest: str) -> str:
    return _str({"sha256": digest}, "sha256", 64, pattern=SHA256_RE)


# ---------------------------------------------------------------------------------------------------------------
# Run manifest
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hyperparameters:
    """Training hyperparameters every peer of a run shares (docs/algorithms.md names them)."""

    inner_steps: int = 30  # H: inner AdamW steps between two outer rounds
    lr: float = 3e-3  # peak inner AdamW learning rate
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int = 128  # tokens per sequence
    k: int = 64  # SparseLoCo: values kept per chunk of 4096
    beta: float = 0.95  # SparseLoCo error-feedback decay
    alpha: float = 1.0  # outer learning rate
    round_deadline_s: float = 30.0  # first outer round's deadline; later ones adapt within the bounds below
    min_deadline_s: float = 5.0  # lower bound of an adapted round deadline
    max_deadline_s: float = 600.0  # upper bound of an adapted round deadline
    min_contributors: int = 1  # a round with fewer accepted contributions by max_deadline_s closes empty
    gather: int = 0  # F: a round accepts at most this many contributions per shard (0: every one; rounds/gather.py)
    reserves: int = 0  # R: further contributions a coordinator checks to replace selected ones that fail
    unselected: str = "drop"  # what a contributor the gather set had no room for does with what it sent: drop, keep
    committee: int = 0  # W: seats that take a round's notices and pass its records on (0: all-to-all; rounds/committee.py)
    # sparseloco (our sparse rounds), diloco (dense, hivemind's stock all-reduce) or noloco (seeded pairs, no
    # all-reduce and no coordinator; full replicas only)
    outer: str = "sparseloco"
    # NoLoCo: the paper's "dense" outer weights and progress between partners, or SparseLoCo's "sparse" payload
    # (measured: its replicas drift apart, docs/results.md "NoLoCo")
    noloco_payload: str = "dense"
    outer_lr: float = 0.7  # DiLoCo: Nesterov outer learning rate
    momentum: float = 0.9  # DiLoCo: Nesterov momentum
    aggregation: str = "selectors"  # SparseLoCo: mean over the replicas that selected a value, or the 1/R "mean"
    weighting: str = "equal"  # contributions weighted equally, or by the "tokens" behind them
    clip_median: bool = True  # scale each contribution to at most the round's median norm (bounded influence)
    small_tensors: str = "topk"  # SparseLoCo: 1-D and sub-chunk tensors sent with the run's k ("topk") or whole
    overlap: str = ""  # exchange beside the next inner phase: none, naive or eager; "" (code only): default_overlap
    max_contribution_ratio: float = 8.0  # a contribution whose norm exceeds this times its shard's is refused
    max_loss_jump: float = 10.0  # a round that multiplies the loss on the run's guard batch by more is refused
    max_update_ratio: float = 8.0  # a round whose update norm exceeds this times a shard's norm is refused
    schedule_steps: int = 0  # inner steps the warm-up + cosine learning-rate schedule spans on every peer (full
    # replicas and swarm drivers alike); 0: 1000 rounds of H

    OUTERS = ("sparseloco", "diloco", "noloco")
    NOLOCO_PAYLOADS = ("dense", "sparse")
    AGGREGATIONS = ("selectors", "mean")
    WEIGHTINGS = ("equal", "tokens")
    SMALL_TENSORS = SMALL_TENSOR_RULES
    OVERLAPS = ("none", "naive", "eager")
    UNSELECTED = ("drop", "keep")
    # Eager for SparseLoCo: `hlbp bench swarm --overlap none,naive,eager` at H = 30 (tiny, 4 replicas, 100 ms RTT,
    # 20 Mbit/s): 97.8 % utilization against 91.5 % without overlap, at 1.0005x its loss (naive 1.079x)
    DEFAULT_OVERLAP: ClassVar[dict[str, str]] = {"sparseloco": "eager", "diloco": "none", "noloco": "none"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap", self.overlap or self.default_overlap(self.outer))

    @classmethod
    def default_overlap(cls, outer: str, constrained: bool = False) -> str:
        """The overlap a run gets when it names none: DEFAULT_OVERLAP, "none" with constrained full replicas."""
        return "none" if constrained else cls.DEFAULT_OVERLAP.get(outer, "none")

    @property
    def schedule_total(self) -> int:
        """Inner steps of the learning-rate schedule (``schedule_steps``, or 1000 rounds of H when it is 0)."""
        return self.schedule_steps or 1000 * self.inner_steps

    @classmethod
    def from_body(cls, body: dict[str, Any], constrained: bool = False) -> Hyperparameters:
        """``constrained``: the run's full replicas train the constrained network (CodecSpec, variants A)."""
        d = cls()
        outer = _str(body, "outer", 16, d.outer, choices=cls.OUTERS)
        hp = cls(
            inner_steps=_int(body, "inner_steps", 1, 1_000_000, d.inner_steps),
            lr=_float(body, "lr", 1e-9, 10.0, d.lr),
            batch_size=_int(body, "batch_size", 1, 1 << 20, d.batch_size),
            seq_len=_int(body, "seq_len", 2, 1 << 20, d.seq_len),
            k=_int(body, "k", 1, 4096, d.k),
            beta=_float(body, "beta", 0.0, 1.0, d.beta),
            alpha=_float(body, "alpha", 0.0, 100.0, d.alpha),
            round_deadline_s=_float(body, "round_deadline_s", 0.1, 86400.0, d.round_deadline_s),
            min_deadline_s=_float(body, "min_deadline_s", 0.1, 86400.0, d.min_deadline_s),
            max_deadline_s=_float(body, "max_deadline_s", 0.1, 86400.0, d.max_deadline_s),
            min_contributors=_int(body, "min_contributors", 1, 256, d.min_contributors),
            gather=_int(body, "gather", 0, 256, d.gather),
            reserves=_int(body, "reserves", 0, 256, d.reserves),
            unselected=_str(body, "unselected", 8, d.unselected, choices=cls.UNSELECTED),
            committee=_int(body, "committee", 0, MAX_COMMITTEE, d.committee),
            outer=outer,
            noloco_payload=_str(body, "noloco_payload", 8, d.noloco_payload, choices=cls.NOLOCO_PAYLOADS),
            outer_lr=_float(body, "outer_lr", 1e-6, 10.0, d.outer_lr),
            momentum=_float(body, "momentum", 0.0, 0.999, d.momentum),
            aggregation=_str(body, "aggregation", 16, d.aggregation, choices=cls.AGGREGATIONS),
            weighting=_str(body, "weighting", 16, d.weighting, choices=cls.WEIGHTINGS),
            clip_median=_bool(body, "clip_median", d.clip_median),
            small_tensors=_str(body, "small_tensors", 16, d.small_tensors, choices=cls.SMALL_TENSORS),
            overlap=_str(body, "overlap", 16, cls.default_overlap(outer, constrained), choices=cls.OVERLAPS),
            max_contribution_ratio=_float(body, "max_contribution_ratio", 1e-6, 1e6, d.max_contribution_ratio),
            max_update_ratio=_float(body, "max_update_ratio", 1e-6, 1e6, d.max_update_ratio),
            max_loss_jump=_float(body, "max_loss_jump", 1.0, 1e9, d.max_loss_jump),
            schedule_steps=_int(body, "schedule_steps", 0, 1 << 40, d.schedule_steps),
        )
        if not hp.min_deadline_s <= hp.round_deadline_s <= hp.max_deadline_s:
            raise ProtocolError("deadlines must satisfy min_deadline_s <= round_deadline_s <= max_deadline_s")
        if hp.gather and hp.min_contributors > hp.gather:
            raise ProtocolError("min_contributors cannot exceed gather: no round could ever close with members")
        if hp.committee and not hp.gather:
            raise ProtocolError("a committee needs a gather set: its seats are the recent rounds' members")
        if hp.gather and hp.outer != "sparseloco":
            raise ProtocolError("a gather set caps sparseloco rounds only; a diloco run's all-reduce takes everyone")
        if hp.outer in ("diloco", "noloco") and hp.overlap != "none":
            raise ProtocolError(f"overlapped rounds are built for sparseloco runs only: a {hp.outer} run sets "
                                'overlap = "none"')
        if hp.outer == "noloco" and (hp.gather or hp.committee):
            raise ProtocolError("a noloco run has no rounds to cap or seat: gather and committee must be 0")
        if constrained and hp.overlap != "none":
            raise ProtocolError("a run with a subspace-a activation codec trains constrained full replicas, which "
                                'do not overlap their rounds yet: set overlap = "none"')
        return hp


@dataclass(frozen=True)
class CodecSpec:
    """How activations cross a stage boundary: dense, or a subspace variant with k values per token."""

    name: str = "dense"  # dense, subspace-a (exact), subspace-a-drift, or subspace-b (decoupled, lossy)
    k: int = 0  # values per token for the subspace codecs; 0 for dense
    dtype: str = ""  # wire dtype: fp32, bf16, fp16 or fp64; "": bf16 for dense, fp32 for the subspace codecs

    NAMES = ("dense", "subspace-a", "subspace-b", "subspace-a-drift")
    CONSTRAINED = ("subspace-a", "subspace-a-drift")  # variants A: every full replica trains the constrained model
    @property
    def constrains_replicas(self) -> bool:
        """Whether the run's full replicas train the constrained network (variants A), as its stage peers do."""
        return self.name in self.CONSTRAINED
    DTYPES = ("", "fp32", "bf16", "fp16", "fp64")

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "k": self.k}
        if self.dtype:  # absent from older manifests: leaving it out keeps their bytes and digests
            out["dtype"] = self.dtype
        return out

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> CodecSpec:
        codec = cls(name=_str(body, "name", 32, "dense", choices=cls.NAMES), k=_int(body, "k", 0, 1 << 16, 0),
                    dtype=_str(body, "dtype", 8, "", choices=cls.DTYPES))
        if codec.name != "dense" and codec.k < 1:
            raise ProtocolError(f"activation codec {codec.name} needs k >= 1")
        return codec


@dataclass(frozen=True)
class Placement:
    """Run-wide thresholds of the role policy, so that every peer applies the same rule."""

    replica_min_throughput: float = 0.0  # full-model tokens/s a peer needs to hold a full replica
    max_peers_per_stage: int = 1  # stage peers per stage of a swarm before a new swarm is opened

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Placement:
        return cls(
            replica_min_throughput=_float(body, "replica_min_throughput", 0.0, 1e12, 0.0),
            max_peers_per_stage=_int(body, "max_peers_per_stage", 1, 1024, 1),
        )


@dataclass(frozen=True)
class Artifact:
    """A file of the run (the tokenizer) that peers fetch by content hash over the data plane."""

    name: str  # file name, e.g. tokenizer.json
    sha256: str  # content hash; the fetcher verifies it
    size: int  # bytes; the fetcher refuses anything longer

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Artifact:
        return cls(
            name=_str(body, "name", 128, pattern=re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")),
            sha256=_str(body, "sha256", 64, pattern=SHA256_RE),
            size=_int(body, "size", 0, MAX_ARTIFACT_BYTES),
        )


_OverrideValue = int | float | str | bool


@dataclass(frozen=True)
class Manifest:
    """Everything that defines a run. The bootstrap signs it; every peer builds the same model from it."""

    run_id: str  # names the run's DHT keys
    seed: int  # seeds model init, data order and the subspace bases
    model: str  # model preset name (hlbp.peer.model.decoder.PRESETS)
    tokenizer_hash: str  # sha256 of tokenizer.json
    stages: tuple[tuple[int, int], ...]  # pipeline partition: [start_layer, end_layer) per stage
    model_overrides: dict[str, _OverrideValue] = field(default_factory=dict)  # preset fields changed for this run
    data_recipe: str = "builtin"  # corpus spec, as hlbp.peer.data.streams understands it
    hparams: Hyperparameters = field(default_factory=Hyperparameters)
    codec: CodecSpec = field(default_factory=CodecSpec)
    placement: Placement = field(default_factory=Placement)
    artifacts: tuple[Artifact, ...] = ()  # files served by hash; includes tokenizer.json
    allowed_peers: tuple[str, ...] = ()  # closed run: only these peer ids may contribute (empty: open to anyone)
    protocol_version: int = PROTOCOL_VERSION
    issued_at: float = 0.0  # signer's clock when issued; the newest manifest of a signer wins

    def artifact(self, name: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.name == name), None)

    def to_body(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "proto": self.protocol_version,
            "issued_at": self.issued_at,
            "seed": self.seed,
            "model": self.model,
            "model_overrides": dict(self.model_overrides),
            "tokenizer_hash": self.tokenizer_hash,
            "data_recipe": self.data_recipe,
            "hparams": asdict(self.hparams),
            "stages": [list(s) for s in self.stages],
            "codec": self.codec.body(),
            "placement": asdict(self.placement),
            "artifacts": [asdict(a) for a in self.artifacts],
            **({"allowed_peers": list(self.allowed_peers)} if self.allowed_peers else {}),
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Manifest:
        proto = _int(body, "proto", 0, 1 << 30)
        if proto != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(proto)
        codec = CodecSpec.from_body(_map(body, "codec"))
        return cls(
            run_id=_str(body, "run", 64, pattern=RUN_ID_RE),
            protocol_version=proto,
            issued_at=_float(body, "issued_at", 0.0, 1e11),
            seed=_int(body, "seed", 0, (1 << 63) - 1),
            model=_str(body, "model", 64),
            model_overrides=_overrides(body.get("model_overrides", {})),
            tokenizer_hash=_str(body, "tokenizer_hash", 64, pattern=SHA256_RE),
            data_recipe=_str(body, "data_recipe", 1024, "builtin"),
            hparams=Hyperparameters.from_body(_map(body, "hparams"), constrained=codec.constrains_replicas),
            stages=check_stages(body.get("stages")),
            codec=codec,
            placement=Placement.from_body(_map(body, "placement")),
            artifacts=_artifacts(body.get("artifacts", [])),
            allowed_peers=_peer_ids(body, "allowed_peers", MAX_ALLOWED_PEERS),
        )

    def may_contribute(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may take part in this run's rounds (always, in an open run)."""
        return not self.allowed_peers or peer_id in self.allowed_peers


class ProtocolVersionMismatch(ProtocolError):
    """The record speaks another protocol version; the message says which, so the user can upgrade."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(
            f"the run uses hlbp protocol version {version}, this hlbp speaks version {PROTOCOL_VERSION}; "
            f"install the hlbp release that matches the run"
        )


def _map(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name, {})
    if not isinstance(value, dict):
        raise ProtocolError(f"record field {name!r} must be a map")
    return value


def _overrides(value: Any) -> dict[str, _OverrideValue]:
    if not isinstance(value, dict) or len(value) > 32:
        raise ProtocolError("model_overrides must be a map of at most 32 entries")
    out: dict[str, _OverrideValue] = {}
    for key, item in value.items():
        _str({"key": key}, "key", 64, pattern=re.compile(r"^[a-z_][a-z0-9_]*$"))
        if isinstance(item, float) and not math.isfinite(item):
            raise ProtocolError(f"model override {key} is not finite")
        if not isinstance(item, (int, float, str, bool)) or (isinstance(item, str) and len(item) > 128):
            raise ProtocolError(f"model override {key} must be a number, a boolean or a short string")
        out[key] = item
    return out


def _peer_ids(body: dict[str, Any], name: str, max_items: int) -> tuple[str, ...]:
    """A sorted list of distinct Ed25519 peer ids (one encoding per set, so one manifest per allow-list)."""
    ids = _str_list(body, name, max_items, 64)
    for peer_id in ids:
        public_key_from_peer_id(peer_id)
    if list(ids) != sorted(set(ids)):
        raise ProtocolError(f"record field {name!r} must list distinct peer ids in sorted order")
    return ids


def _artifacts(value: Any) -> tuple[Artifact, ...]:
    if not isinstance(value, list) or len(value) > 16:
        raise ProtocolError("artifacts must be a list of at most 16 entries")
    return tuple(Artifact.from_body(item if isinstance(item, dict) else {}) for item in value)


def check_stages(value: Any) -> tuple[tuple[int, int], ...]:
    """A stage partition: 1..256 contiguous ``[start, end)`` layer ranges starting at layer 0."""
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 256:
        raise ProtocolError("stages must be a list of 1..256 [start, end) pairs")
    stages: list[tuple[int, int]] = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ProtocolError(f"stage {i} must be a [start, end) pair")
        start = _int({"start": pair[0]}, "start", 0, 1 << 16)
        end = _int({"end": pair[1]}, "end", 1, 1 << 16)
        expected = stages[-1][1] if stages else 0
        if start != expected or end <= start:
            raise ProtocolError(f"stage {i} is [{start}, {end}); stages must be contiguous from layer 0")
        stages.append((start, end))
    return tuple(stages)


def describe_stages(stages: Iterable[tuple[int, int]]) -> str:
    """Each stage's layers for a person to read, inclusive: ``0-2, 3`` for ``[(0, 3), (3, 4)]``."""
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in stages)


@dataclass(frozen=True)
class SignedManifest:
    manifest: Manifest
    signer: str  # peer id of the signer
    digest: str  # sha256 of the envelope; peers name the manifest they follow by (signer, digest)
    envelope: bytes  # the signed bytes, re-publishable verbatim by any peer


def encode_manifest(manifest: Manifest, identity: Identity) -> bytes:
    data = seal(KIND_MANIFEST, manifest.to_body(), identity)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ProtocolError(f"the manifest encodes to {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    return data


def decode_manifest(data: Any, *, signer: str | None = None) -> SignedManifest:
    """Verify and parse a manifest envelope. A manifest of another protocol version raises
    :class:`ProtocolVersionMismatch`."""
    env = open_envelope(data, KIND_MANIFEST, max_bytes=MAX_MANIFEST_BYTES, signer=signer)
    return SignedManifest(Manifest.from_body(env.body), env.signer, env.digest, data)
