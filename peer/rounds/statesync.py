"""State sync: how a peer's agreed shard state is served, and fetched from several donors in parallel.

A donor serves each shard as a safetensors blob: ``p.<name>`` for parameters, ``o.<key>`` for the outer optimizer's
global state (DiLoCo momentum; error-feedback buffers are private and never leave a peer). A joiner or an out-of-sync
peer fetches the shards from different donors at once and checks every one against the checksum the majority
published, so a lying donor costs one retry, not a wrong model. The checksum covers the served optimizer state as
well as the parameters, and :func:`parse_state` accepts only float32, finite optimizer entries named after the
shard's own parameters with their shapes. Serving is a dictionary lookup in the transport's own thread: it never
blocks a donor's training.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hlbp.peer.net.transport import STATE_PREFIX, BlobTransport, TransportError
from hlbp.peer.rounds.anchor import Anchor
from hlbp.protocol import ProtocolError
from hlbp.protocol.dense import ST_ITEMSIZE, read_header

OUTER_PREFIXES = ("ef.", "momentum.")
"""Outer optimizer state entries, each ``<prefix><parameter name>``; ``ef.`` (error feedback) is private."""
PRIVATE_PREFIX = "ef."


def public_outer_state(outer_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The outer optimizer state a donor serves and the checksum covers: everything but error feedback."""
    return {k: outer_state[k] for k in outer_state if not k.startswith(PRIVATE_PREFIX)}  # error feedback never read


def shard_checksum(
    params: Mapping[str, torch.Tensor], names: Sequence[str], outer_state: Mapping[str, torch.Tensor] | None = None
) -> str:
    """sha256 over the names, shapes and float32 bytes of a shard's tensors, in name order, then over the public
    outer optimizer state (:func:`public_outer_state` of ``outer_state``) the same way.

    The optimizer state is covered so that a donor cannot serve honest parameters with poisoned momentum. With no
    public optimizer state (SparseLoCo keeps only private error feedback) the checksum is the parameters' alone.
    """
    h = hashlib.sha256()
    for name in sorted(names):
        t = params[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}|{tuple(t.shape)}|".encode())
        h.update(t.numpy())  # the tensor's buffer itself: no copy of its bytes
    public = public_outer_state(outer_state or {})
    for key in sorted(public):
        t = public[key].detach().to("cpu", torch.float32).contiguous()
        h.update(f"o.{key}|{tuple(t.shape)}|".encode())
        h.update(t.numpy())  # the tensor's buffer itself: no copy of its bytes
    return h.hexdigest()


_SIGNS: dict[tuple[str, int], torch.Tensor] = {}


def shard_fingerprint(params: dict[str, torch.Tensor], names: Sequence[str]) -> tuple[float, float]:
    """(dot with a fixed pseudo-random sign pattern, L2 norm) of a shard, in float64.

    Why: hivemind's all-reduce hands each peer ``local + (average - local)``, which differs from the average by an
    ulp in about a third of the values, so dense replicas never agree bit for bit. Replicas that applied the same
    rounds agree on these two numbers to about 1e-7 relative; one that missed a round is off by the size of an
    outer step (1e-4 and up), since a random sign pattern is not orthogonal to the update.
    """
    dot, sq = 0.0, 0.0
    for name in sorted(names):
        t = params[name].detach().to("cpu", torch.float64).reshape(-1)
        key = (name, t.numel())
        signs = _SIGNS.get(key)
        if signs is None:
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
            signs = _SIGNS[key] = torch.randint(0, 2, (t.numel(),), generator=g, dtype=torch.int8) * 2 - 1
        dot += float(t @ signs.to(torch.float64))
        sq += float(t @ t)
    return dot, sq**0.5


def state_name(round_: int, shard: int) -> str:
    """Transport name of a shard's state after ``round_``."""
    return f"{STATE_PREFIX}{round_}/{shard}"


def encode_state(
    params: Mapping[str, torch.Tensor], names: Sequence[str], outer_state: Mapping[str, torch.Tensor]
) -> bytes:
    """One shard's state blob: its parameters and the outer optimizer's global (non-EF) state, as float32."""
    tensors = {f"p.{n}": params[n] for n in names}
    tensors.update({f"o.{k}": v for k, v in public_outer_state(outer_state).items()})
    return st_save({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()})


class ServedState:
    """One shard's state after a round, served on request (``BlobTransport.put_lazy``) without a copy of it.

    It reads the anchor's parameters of the shard when asked, as long as none was written since the round this
    state is of: the round loop replaces them one at a time and never changes one in place, so while the anchor's
    versions of them are unchanged they are that round's. Once a later round has written one, the state is gone
    and a request hears "not here" (the fetcher then asks for a newer round); a write while the blob was made is
    seen afterwards, and that blob is not served either. The outer optimizer's public state (DiLoCo's momentum,
    changed in place) is copied; SparseLoCo has none. So serving costs no memory beside the anchor (docs/design.md,
    "Memory"), where an encoded blob per round held the shard twice more."""

    def __init__(self, anchor: Anchor, names: Sequence[str], outer_state: Mapping[str, torch.Tensor]) -> None:
        self._anchor, self._version, self._names = anchor, anchor.version, list(names)
        self._outer = {k: v.detach().clone() for k, v in public_outer_state(outer_state).items()}

    def __call__(self) -> bytes | None:
        """The state blob (:func:`encode_state`), or None when the round's parameters are gone."""
        if not self._anchor.unchanged_since(self._names, self._version):
            return None
        blob = encode_state(self._anchor, self._names, self._outer)
        return blob if self._anchor.unchanged_since(self._names, self._version) else None


@dataclass
class ShardState:
    """A verified shard state: parameters by name and the outer optimizer's global state."""

    params: dict[str, torch.Tensor]
    outer: dict[str, torch.Tensor]


def _state_name(key: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    """Expected shape of blob entry ``key``: ``p.<param>`` or ``o.momentum.<param>`` of a parameter of the shard."""
    if key.startswith("p.") and key[2:] in shapes:
        return "param", tuple(shapes[key[2:]])
    for prefix in OUTER_PREFIXES:
        if prefix != PRIVATE_PREFIX and key.startswith("o." + prefix) and key[2 + len(prefix):] in shapes:
            return "outer", tuple(shapes[key[2 + len(prefix):]])
    raise ProtocolError(f"state blob holds {key[:80]!r}, which is no parameter or public optimizer state of the shard")


def parse_state(blob: bytes, shapes: dict[str, tuple[int, ...]]) -> ShardState:
    """A donor's untrusted state blob, checked against the shard's names, shapes and finiteness.

    Every entry must be float32 and finite: ``p.<param>`` for each parameter of the shard (all of them), and
    optionally ``o.momentum.<param>`` with that parameter's shape. The header is checked before anything is loaded.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"state blob must be bytes, got {type(blob).__name__}")
    header = read_header(blob, dtypes={"F32": ST_ITEMSIZE["F32"]}, what="state blob")
    kinds = {}
    for key, (_, shape) in header.items():
        kind, want = _state_name(key, shapes)
        if shape != want:
            raise ProtocolError(f"state tensor {key[:80]} has shape {shape}, expected {want}")
        kinds[key] = kind
    if {k[2:] for k, kind in kinds.items() if kind == "param"} != set(shapes):
        raise ProtocolError("state blob does not hold exactly the shard's parameters")
    try:
        tensors = st_load(bytes(blob))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type and ValueError
        raise ProtocolError(f"state blob is not safetensors: {exc}") from None
    for key, t in tensors.items():
        if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
            raise ProtocolError(f"state tensor {key[:80]} is not float32 or has non-finite values")
    params = {k[2:]: v for k, v in tensors.items() if kinds.get(k) == "param"}
    return ShardState(params, {k[2:]: v for k, v in tensors.items() if kinds.get(k) == "outer"})


def fetch_state(
    transport: BlobTransport,
    donors: Sequence[str],
    round_: int,
    shapes: Mapping[int, dict[str, tuple[int, ...]]],
    checksums: Mapping[str, Mapping[int, str]],
    max_bytes: int,
    timeout: float,
    workers: int,
) -> tuple[dict[int, ShardState], int]:
    """The state after ``round_`` of every shard in ``shapes`` (shard -> its tensor shapes), each from a different
    donor first, verified against the checksum the donor is expected to hold (``checksums[donor][shard]``: the
    majority's in a sparse run, the donor's own in a dense run, whose donors were chosen by fingerprint). A donor
    with no checksum for a shard (a stage peer holds one shard) is not asked for it.

    Returns the states by shard and the bytes fetched; raises :class:`TransportError` if some shard could be had
    from no donor (each donor is tried once per shard, so the work is bounded).
    """
    fetched = dict.fromkeys(shapes, 0)

    def one(s: int) -> ShardState:
        errors = []
        holders = [d for d in donors if s in checksums.get(d, {})]
        for donor in [*holders[s % max(1, len(holders)):], *holders[: s % max(1, len(holders))]]:
            try:
                blob = transport.fetch(donor, state_name(round_, s), max_bytes, timeout)
                fetched[s] += len(blob)
                state = parse_state(blob, shapes[s])
                if shard_checksum(state.params, list(shapes[s]), state.outer) != checksums[donor][s]:
                    raise ProtocolError("state does not match the published checksum")
                return state
            except (TransportError, ProtocolError) as exc:
                errors.append(f"{donor[:12]}…: {exc}")
        raise TransportError(f"shard {s}: " + ("; ".join(errors[:3]) or "no donor holds it"))

    order = list(shapes)
    with ThreadPoolExecutor(max(1, min(len(order), workers))) as pool:
        states = dict(zip(order, pool.map(one, order)))
    return states, sum(fetched.values())
