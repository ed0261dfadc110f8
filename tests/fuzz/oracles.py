"""Re-signing mutated records, and the oracles that judge an input a decoder ACCEPTED.

An accepted input must satisfy its family's oracle: finite outputs, canonical shard keys, no trailing newline in
an id or digest, only public optimizer state of the shard's parameters, a zstd frame with nothing after it.
A violation raises :class:`BadAccept`, which the checker counts apart from exceptions.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import torch
from mutators import flip_bytes, mutate_tree, pack_tree

from hlbp.peer.rounds.statesync import parse_state
from hlbp.protocol.identity import ENVELOPE_MAGIC, ENVELOPE_SCHEMA, Identity, _signed_message, b58decode

SHAPES = {"blocks.0.attn.wq.weight": (64, 128), "norm.weight": (130,)}
"""The shard every contribution, dense body and state blob of the fuzzer is for."""

# --- signed records: seal again after the body was mutated -------------------------------------------------------


def reseal(kind: str, body_bytes: bytes, identity: Identity) -> bytes:
    """An envelope over arbitrary (mutated) body bytes, validly signed: the parser's deep checks run."""
    signer = b58decode(identity.peer_id)
    signature = identity.sign(_signed_message(kind, signer, body_bytes))
    return msgpack.packb([ENVELOPE_MAGIC, ENVELOPE_SCHEMA, kind, signer, body_bytes, signature], use_bin_type=True)


def mutate_sealed(rng: random.Random, data: bytes, kind: str, identity: Identity) -> bytes:
    """Mutate a sealed record: mostly its body (then re-signed), sometimes the envelope or the raw bytes."""
    items = msgpack.unpackb(data, raw=False)
    r = rng.random()
    if r < 0.75:
        body = msgpack.unpackb(items[4], raw=False)
        body = mutate_tree(rng, body, n=rng.choice([1, 1, 2, 3]))
        return reseal(kind, pack_tree(body), identity)
    if r < 0.9:
        return pack_tree(mutate_tree(rng, items, n=1))
    return flip_bytes(rng, data)


# --- oracles: what an accepted input must satisfy ---------------------------------------------------------------


class BadAccept(AssertionError):
    """A decoder accepted an input that breaks the contract (non-finite output, non-canonical key, ...)."""


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise BadAccept(what)


def finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        expect(bool(torch.isfinite(t.float()).all()), f"{what}: {name} decoded to NaN or inf")


def no_newline(*texts: str) -> None:
    for t in texts:
        expect("\n" not in t, f"accepted a field with a newline: {t[-20:]!r}")


def check_contribution(inp: Any, out: Any) -> None:
    from hlbp.protocol.sparse import decompress

    dense = {n: decompress(t) if not isinstance(t, torch.Tensor) else t for n, t in out.tensors.items()}
    finite(dense, "contribution")


def check_records(inp: Any, out: Any) -> None:
    body = msgpack.unpackb(msgpack.unpackb(inp[1], raw=False, strict_map_key=False)[4], raw=False,
                           strict_map_key=False)
    for key, parsed in (("digests", getattr(out, "digests", None)), ("sizes", getattr(out, "sizes", None)),
                        ("checksums", getattr(out, "checksums", None))):
        if parsed is not None:
            raw = body[key]
            expect(sorted(raw) == sorted(str(k) for k in parsed), f"shard keys {list(raw)[:4]} not canonical")
            no_newline(*parsed.values() if key != "sizes" else [])
    for sender, _, digests in getattr(out, "members", ()):
        no_newline(sender, *digests.values())


def check_state(inp: Any, out: Any) -> None:
    state = parse_state(inp, dict(SHAPES))
    for key, t in {**state.params, **state.outer}.items():
        expect(t.dtype == torch.float32 and bool(torch.isfinite(t).all()), f"state {key} not finite float32")
    for key, t in state.outer.items():
        expect(key.startswith("momentum.") and tuple(t.shape) == SHAPES.get(key[9:]),
                f"state sync accepted optimizer entry {key!r} of shape {tuple(t.shape)}")


def check_zstd(inp: Any, out: bytes) -> None:
    import zstandard

    d = zstandard.ZstdDecompressor().decompressobj()
    full = d.decompress(inp[0])
    expect(d.eof and not d.unused_data and full == out, "zstd frame accepted with trailing data or wrong size")


