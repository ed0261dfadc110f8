"""Contributions to and from wire bytes: the outer optimizer's codec body inside a signed-ready envelope.

The envelope names run, round, shard, sender and tokens; the body is a SparseLoCo shard (sparse, 2-bit) or a
dense DiLoCo payload. A receiver checks that the envelope is for the round and shard it expects and that the codec
parameters are the run's, before it decodes a single tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

from hlbp.peer.rounds.outer import Contribution, OuterConfig
from hlbp.protocol import ProtocolError
from hlbp.protocol.dense import decode_dense, dense_max_size, encode_dense
from hlbp.protocol.envelope import MAX_HEADER_BYTES, PREFIX_SIZE, EnvelopeHeader, pack, unpack
from hlbp.protocol.shard import ShardLimits, decode_shard_sparse, encode_shard, max_shard_size

DEFAULT_INDEX_FORMAT = "entropy"


def codec_of(cfg: OuterConfig, index_format: str = DEFAULT_INDEX_FORMAT) -> tuple[str, dict]:
    """Codec name and parameters that a run's contributions carry and receivers insist on."""
    if cfg.kind == "sparseloco":
        params = {"k": cfg.k, "q": cfg.quant_bits or 0, "fmt": index_format}
        if cfg.small_tensors != "topk":  # named only when not the default, so default runs keep their bytes
            params["small"] = cfg.small_tensors
        return "sparseloco", params
    return f"dense-{cfg.wire_dtype}", {}


def contribution_to_bytes(
    c: Contribution, cfg: OuterConfig, run: str, round: int, shard: int, index_format: str = DEFAULT_INDEX_FORMAT
) -> bytes:
    """One framed contribution, ready to send or to serve to any peer that asks."""
    codec, params = codec_of(cfg, index_format)
    if cfg.kind == "sparseloco":
        body = encode_shard(c.tensors, index_format)  # type: ignore[arg-type]
        compress = False  # the entropy format is already dense in information; zstd would only cost time
    else:
        body = encode_dense(c.tensors, cfg.wire_dtype)  # type: ignore[arg-type]
        compress = False  # float noise does not compress; measured in `hlbp bench codec` (zstd-only row)
    header = EnvelopeHeader(run=run, round=round, shard=shard, sender=c.sender, tokens=c.tokens, codec=codec,
                            codec_params=params)
    return pack(header, body, compress=compress)


def contribution_from_bytes(
    data: bytes,
    cfg: OuterConfig,
    expected: Mapping[str, tuple[int, ...]],
    run: str | None = None,
    round: int | None = None,
    shard: int | None = None,
    max_bytes: int = 1 << 30,
) -> Contribution:
    """Parse untrusted bytes into a contribution for the expected run, round, shard and tensor shapes.

    Every defect raises :class:`ProtocolError`: wrong run, round or shard; a codec other than the run's; any
    malformation of envelope or body. The body may be no larger than the largest valid body for ``expected``
    (and ``max_bytes``), checked before it is decompressed or hashed, so a small frame cannot claim a large body.
    """
    if cfg.kind == "sparseloco":
        max_body = max_shard_size(expected, cfg.k, cfg.quant_bits, cfg.small_tensors)
    else:
        max_body = dense_max_size(expected, cfg.wire_dtype)
    max_body = min(max_body, max_bytes)
    header, body = unpack(data, min(max_bytes, PREFIX_SIZE + MAX_HEADER_BYTES + max_body), max_body)
    for name, want, got in (("run", run, header.run), ("round", round, header.round), ("shard", shard, header.shard)):
        if want is not None and want != got:
            raise ProtocolError(f"contribution is for {name} {got!r}, expected {want!r}")
    if header.tokens < 0:
        raise ProtocolError(f"contribution claims {header.tokens} tokens")
    codec, params = codec_of(cfg, str(header.codec_params.get("fmt", DEFAULT_INDEX_FORMAT)))
    if header.codec != codec or any(header.codec_params.get(k) != v for k, v in params.items()):
        raise ProtocolError(f"contribution uses codec {header.codec} {header.codec_params}, the run uses {codec} {params}")
    if cfg.kind == "sparseloco":
        limits = ShardLimits(max_bytes=max_body, k=cfg.k, allow_unquantized=cfg.quant_bits is None,
                             small_tensors=cfg.small_tensors)
        tensors = decode_shard_sparse(body, expected, limits)
        quantized = {s.quantized for s in tensors.values()}
        if quantized and quantized != {cfg.quant_bits is not None}:
            raise ProtocolError("contribution's value quantisation differs from the run's")
    else:
        tensors = decode_dense(body, dict(expected), cfg.wire_dtype, max_bytes=max_body)
    return Contribution(sender=header.sender, tokens=header.tokens, tensors=tensors)
