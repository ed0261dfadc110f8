"""hlbp.protocol: bytes on the wire. Pure schemas, codecs and validation; no network, no global state."""

from hlbp.protocol.envelope import EnvelopeHeader, body_digest, pack, unpack
from hlbp.protocol.errors import ProtocolError, RecordExpired
from hlbp.protocol.shard import ShardLimits, decode_shard, decode_shard_sparse, encode_shard, packed12_size
from hlbp.protocol.sparse import SparseTensor, chunk_layout, compress, decompress, payload_bits_formula

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
