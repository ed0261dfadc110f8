"""hlbp.protocol: bytes on the wire. Pure schemas, codecs and validation; no network, no global state.

The tensor codecs (``shard``, ``sparse``) need torch; they are imported when first named, so that what only reads
records, manifests or envelopes (the CLI's help and error paths among them) starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from hlbp.protocol.envelope import EnvelopeHeader, body_digest, pack, unpack
from hlbp.protocol.errors import ProtocolError, RecordExpired

_LAZY = {
    "ShardLimits": "shard", "decode_shard": "shard", "decode_shard_sparse": "shard", "encode_shard": "shard",
    "packed12_size": "shard", "SparseTensor": "sparse", "chunk_layout": "sparse", "compress": "sparse",
    "decompress": "sparse", "payload_bits_formula": "sparse",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "EnvelopeHeader",
    "ProtocolError",
    "RecordExpired",
    "ShardLimits",
    "SparseTensor",
    "body_digest",
    "chunk_layout",
    "compress",
    "decode_shard",
    "decode_shard_sparse",
    "decompress",
    "encode_shard",
    "pack",
    "packed12_size",
    "payload_bits_formula",
    "unpack",
]
