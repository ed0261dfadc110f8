"""The body of a ``share`` message: what one peer of a stage accumulated in a step, for the other peers that served
the same stage in that step (:mod:`hlbp.peer.swarm.shares`).

Layout: a bitmask of the step's micro-batches that the sender accumulated (``ceil(count / 8)`` bytes, bit ``i % 8``
of byte ``i // 8`` is micro-batch ``i``), then the sender's accumulated gradient of every parameter of the stage as
fp32 safetensors (:mod:`hlbp.protocol.dense`), or nothing when the sender's gradient is not finite (the step is
then skipped on every stage, as a non-finite norm skips it today).

fp32 because the peers of a stage add each other's shares and must reach the same bits: a narrower wire type would
round the sender's share for the others but not for itself. The receiver knows the count and the stage's shapes, so
the size is checked before anything is parsed; every defect raises :class:`~hlbp.protocol.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from hlbp.protocol.dense import decode_dense, dense_max_size, encode_dense
from hlbp.protocol.errors import ProtocolError

MAX_COUNT = 4096  # the most micro-batches a step may have (as the stage wire's header says)


def mask_bytes(count: int) -> int:
    """Bytes of the micro-batch bitmask of a step of ``count`` micro-batches."""
    return (count + 7) // 8


def max_share_bytes(count: int, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The largest share body a stage of ``shapes`` accepts for a step of ``count`` micro-batches."""
    return mask_bytes(count) + dense_max_size(shapes, "fp32")


@dataclass(frozen=True)
class Share:
    """A decoded share: the micro-batches it covers and the gradient (None: the sender's was not finite)."""

    mbs: frozenset[int]
    grads: dict[str, torch.Tensor] | None


def encode_share(mbs: Collection[int], count: int, grads: Mapping[str, torch.Tensor] | None) -> bytes:
    """The body of a share of micro-batches ``mbs`` (each below ``count``) with gradient ``grads`` (None: not
    finite)."""
    if not 0 < count <= MAX_COUNT or any(not 0 <= i < count for i in mbs):
        raise ValueError(f"micro-batches {sorted(mbs)[:4]} of a step of {count}")
    mask = bytearray(mask_bytes(count))
    for i in mbs:
        mask[i // 8] |= 1 << (i % 8)
    return bytes(mask) + (b"" if grads is None else encode_dense(dict(grads), "fp32"))


def decode_share(body: bytes, count: int, shapes: Mapping[str, tuple[int, ...]]) -> Share:
    """A share for a step of ``count`` micro-batches on a stage of ``shapes``; sizes are checked first."""
    if not 0 < count <= MAX_COUNT:
        raise ProtocolError(f"a share of a step of {count} micro-batches")
    n = mask_bytes(count)
    if len(body) < n or len(body) > max_share_bytes(count, shapes):
        raise ProtocolError(f"a share body of {len(body)} bytes for {count} micro-batches")
    mask = body[:n]
    mbs = frozenset(i for i in range(count) if mask[i // 8] >> (i % 8) & 1)
    if any(mask[i // 8] >> (i % 8) & 1 for i in range(count, 8 * n)):
        raise ProtocolError("a share marks micro-batches past the step's count")
    if not mbs:
        raise ProtocolError("a share of no micro-batch")
    rest = body[n:]
    if not rest:
        return Share(mbs, None)
    return Share(mbs, decode_dense(rest, {k: tuple(v) for k, v in shapes.items()}, "fp32"))
