"""SparseLoCo codec: chunking, top-k, 2-bit quantisation, both index formats and the untrusted-input decoder."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlbp.protocol import (
    ProtocolError,
    ShardLimits,
    compress,
    decode_shard,
    decode_shard_sparse,
    decompress,
    encode_shard,
    packed12_size,
    payload_bits_formula,
)
from hlbp.protocol.indexcodec import pack12, unpack12
from hlbp.protocol.sparse import chunk_layout, kept_per_chunk

SHAPES = {
    "blocks.0.attn.wq.weight": (128, 192),
    "blocks.0.mlp.w1.weight": (100, 48),
    "blocks.0.attn.wo.weight": (97, 64),
    "blocks.0.ln.weight": (5000,),
    "blocks.0.conv.weight": (3, 4, 5),
    "blocks.0.scale": (),
}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensors(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def _compressed(shapes: dict = SHAPES, k: int = 64, quant_bits: int | None = 2, seed: int = 0) -> dict:
    return {name: compress(t, k, quant_bits) for name, t in _tensors(shapes, seed).items()}


# ---------------------------------------------------------------- chunking


@pytest.mark.parametrize(
    ("shape", "tile", "groups"),
    [
        ((256, 512), (64, 64), [(32, 4096, 64)]),
        ((100, 48), (50, 48), [(2, 2400, 38)]),
        ((97, 64), (1, 64), [(97, 64, 1)]),
        ((97, 97), (1, 1), [(9409, 1, 1)]),
        ((3, 4, 5), (3, 20), [(1, 60, 1)]),
        ((5000,), None, [(1, 4096, 64), (1, 904, 14)]),
        ((8192,), None, [(2, 4096, 64)]),
        ((), None, [(1, 1, 1)]),
        ((0, 5), None, []),
    ],
)
def test_chunk_layout(shape, tile, groups):
    layout = chunk_layout(shape, 64)
    assert layout.tile == tile
    assert [(g.n_chunks, g.chunk_size, g.k) for g in layout.groups] == groups
    assert sum(g.n_chunks * g.chunk_size for g in layout.groups) == math.prod(shape)


def test_kept_per_chunk_keeps_density():
    assert kept_per_chunk(64, 4096) == 64
    assert kept_per_chunk(128, 2048) == 64
    assert kept_per_chunk(64, 1) == 1
    assert kept_per_chunk(4096, 100) == 100


@pytest.mark.parametrize("shape", [(128, 192), (100, 48), (97, 64), (5000,), (3, 4, 5)])
def test_topk_keeps_the_largest_per_chunk(shape):
    torch.manual_seed(1)
    t = torch.randn(shape)
    layout = chunk_layout(shape, 64)
    s = compress(t, 64, quant_bits=None)
    dense = decompress(s)
    kept = dense != 0
    # tile the original exactly as the layout says and compare the kept set with a brute-force top-k per chunk
    flat = t.reshape(-1)
    if layout.tile is not None:
        tr, tc = layout.tile
        rows, cols = shape[0], layout.cols
        perm = torch.arange(flat.numel()).view(rows // tr, tr, cols // tc, tc).permute(0, 2, 1, 3)
        chunks = [perm.reshape(-1, tr * tc)]
    else:
        chunks, start = [], 0
        for g in layout.groups:
            chunks.append(
                torch.arange(start, start + g.n_chunks * g.chunk_size).view(g.n_chunks, g.chunk_size)
            )
            start += g.n_chunks * g.chunk_size
    for g, positions in zip(layout.groups, chunks):
        for row in positions:
            want = set(row[flat[row].abs().topk(g.k).indices].tolist())
            got = set(row[kept.reshape(-1)[row]].tolist())
            assert got == want
    assert torch.equal(dense[kept], t[kept])
    assert int(kept.sum()) == layout.nnz


@pytest.mark.parametrize("shape", [(8192, 512), (300, 4096), (97, 64), (20000,), (4096 * 5 + 17,), (3, 5, 64)])
@pytest.mark.parametrize("quant_bits", [2, None])
def test_ranking_a_block_of_chunks_at_a_time_gives_the_same_fields(shape, quant_bits):
    """compress ranks a host tensor's chunks a block at a time; any block size gives the fields the whole gives,
    ties among equal magnitudes (rows of zeros, repeated values) included."""
    g = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(shape, generator=g)
    flat = t.view(-1)
    flat[: flat.numel() // 3] = 0.0  # whole chunks of ties (an embedding's unseen rows)
    flat[flat.numel() // 2: flat.numel() // 2 + 5000] = 0.25  # ties among kept values
    whole = compress(t, 64, quant_bits, block_values=t.numel())
    for block in (1, 4096, 64 * 4096 + 1, 1 << 20):
        got = compress(t, 64, quant_bits, block_values=block)
        assert torch.equal(got.indices, whole.indices)
        for field in ("codes", "table", "values"):
            a, b = getattr(got, field), getattr(whole, field)
            assert (a is None and b is None) or torch.equal(a, b)
        assert got.shift == whole.shift


def test_indices_sorted_within_chunks():
    s = compress(torch.randn(256, 256), 64)
    idx = s.indices.to(torch.int64).view(-1, 64)
    assert bool((idx.diff(dim=1) > 0).all())


def test_non_contiguous_input_and_flat_indices():
    torch.manual_seed(5)
    t = torch.randn(192, 128).t()
    s = compress(t, 64, quant_bits=None)
    assert torch.equal(decompress(s), decompress(compress(t.contiguous(), 64, quant_bits=None)))
    dense = torch.zeros(t.numel())
    dense.index_add_(0, s.flat_indices(), s.dense_values())
    assert torch.equal(dense.view(t.shape), decompress(s))


def test_encode_rejects_mixed_quantisation():
    mixed = {"a": compress(torch.randn(64, 64)), "b": compress(torch.randn(64, 64), quant_bits=None)}
    with pytest.raises(ValueError):
        encode_shard(mixed)


def test_compress_rejects_non_finite():
    t = torch.randn(64, 64)
    t[3, 5] = float("nan")
    with pytest.raises(ValueError):
        compress(t)
    t[3, 5] = float("inf")
    with pytest.raises(ValueError):
        compress(t)


# ---------------------------------------------------------------- quantisation


def test_lookup_table_is_bin_means():
    torch.manual_seed(2)
    t = torch.distributions.StudentT(3.0).sample((256, 256))
    raw = compress(t, 64, quant_bits=None)
    s = compress(t, 64)
    assert torch.equal(s.indices, raw.indices)
    v = raw.values.to(torch.float64)
    c = v - v.mean()
    scale = 1.5 * c.std(correction=0)
    q = torch.clamp(torch.round(c / scale + 2), 0, 3).to(torch.int64)
    assert torch.equal(s.codes.to(torch.int64), q)
    for b in range(4):
        if (q == b).any():
            assert s.table[b].item() == pytest.approx(c[q == b].mean().item(), rel=1e-6)
        else:
            assert s.table[b].item() == pytest.approx(((b - 2) * scale).item(), rel=1e-6)
    assert s.shift == pytest.approx(v.mean().item(), rel=1e-6)
    assert torch.equal(s.dense_values(), s.table[s.codes.long()] + torch.tensor(s.shift, dtype=torch.float32))


def test_empty_bin_gets_nominal_centre():
    # Gaussian top-k values sit near +-2.7 sigma of the input, so the codes are 1 or 3 and bins 0 and 2 stay empty
    torch.manual_seed(3)
    t = torch.randn(512, 512)
    s, raw = compress(t, 64), compress(t, 64, quant_bits=None)
    v = raw.values.to(torch.float64)
    scale = 1.5 * (v - v.mean()).std(correction=0)
    counts = torch.bincount(s.codes.long(), minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    for b in (0, 2):
        assert s.table[b].item() == pytest.approx(((b - 2) * scale).item(), rel=1e-6)


@pytest.mark.parametrize(
    "t", [torch.full((64, 64), 0.25), torch.tensor([3.5]), torch.zeros(10), torch.tensor(7.0)]
)
def test_degenerate_values_are_exact(t):
    s = compress(t)
    assert bool((s.codes == 2).all())
    dense = decompress(s)
    kept = decompress(compress(t, quant_bits=None)) != 0
    assert torch.equal(dense[kept], t[kept])


def test_error_feedback_identity():
    torch.manual_seed(4)
    e = torch.randn(128, 128)
    approx = decompress(compress(e))
    residual = e - approx
    assert torch.equal(residual + approx, e)
    # everything not sent stays in the buffer untouched
    assert torch.equal(residual[approx == 0], e[approx == 0])


# ---------------------------------------------------------------- serialisation


@pytest.mark.parametrize("quant_bits", [2, None])
@pytest.mark.parametrize("k", [1, 32, 64, 128, 4096])
def test_packed12_size_is_exact(k, quant_bits):
    sp = _compressed(k=k, quant_bits=quant_bits)
    assert len(encode_shard(sp, "packed12")) == packed12_size(SHAPES, k, quant_bits)


def test_packed12_matches_nominal_formula():
    sp = {"w": compress(torch.randn(1024, 1024), 64)}
    body = len(encode_shard(sp, "packed12"))
    nominal = payload_bits_formula(1024 * 1024, 64) / 8
    assert nominal <= body <= nominal + 64


@pytest.mark.parametrize("quant_bits", [2, None])
def test_both_formats_round_trip_identically(quant_bits):
    sp = _compressed(quant_bits=quant_bits)
    decoded = {fmt: decode_shard_sparse(encode_shard(sp, fmt), SHAPES) for fmt in ("packed12", "entropy")}
    for name, s in sp.items():
        want = decompress(s)
        for fmt in decoded:
            got = decoded[fmt][name]
            assert torch.equal(got.indices, s.indices), fmt
            assert torch.equal(decompress(got), want), fmt
    assert list(decoded["entropy"]) == list(SHAPES)
    dense = decode_shard(encode_shard(sp), SHAPES)
    assert all(dense[n].dtype == torch.float32 and dense[n].shape == SHAPES[n] for n in SHAPES)


def test_entropy_beats_packed12():
    sp = {"w": compress(torch.randn(1024, 1024), 64)}
    entropy, packed = len(encode_shard(sp, "entropy")), len(encode_shard(sp, "packed12"))
    assert 8 * entropy / 1024**2 < 0.16 < 8 * packed / 1024**2 <= 0.22


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(st.integers(1, 150), min_size=0, max_size=3),
    k=st.sampled_from([1, 7, 64, 200]),
    quant=st.sampled_from([2, None]),
    fmt=st.sampled_from(["packed12", "entropy"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(dims, k, quant, fmt, seed):
    shape = tuple(dims)
    torch.manual_seed(seed)
    s = compress(torch.randn(shape), k, quant)
    out = decode_shard_sparse(encode_shard({"t": s}, fmt), {"t": shape})["t"]
    assert torch.equal(out.indices, s.indices)
    assert torch.equal(decompress(out), decompress(s))


# ---------------------------------------------------------------- decoder rejections


def _body(sp: dict | None = None, fmt: str = "packed12") -> dict:
    return msgpack.unpackb(encode_shard(sp or _compressed(), fmt), raw=False)


def _reject(
    body: dict | bytes, match: str, expected: dict = SHAPES, limits: ShardLimits | None = None
) -> None:
    data = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    with pytest.raises(ProtocolError, match=match):
        decode_shard(data, expected, limits)


def _set_indices(body: dict, change) -> None:
    n = sum(chunk_layout(SHAPES[e[0]], e[1]).nnz for e in body["t"])
    idx = unpack12(body["idx"], n).astype(np.int64)
    change(idx)
    body["idx"] = pack12(idx)


def test_rejects_index_out_of_range():
    body = _body()
    # tensor 1 is (100, 48): chunks of 2400 values, so 4000 fits in 12 bits but not in the chunk
    offset = chunk_layout(SHAPES["blocks.0.attn.wq.weight"], 64).nnz
    _set_indices(body, lambda idx: idx.__setitem__(offset + 37, 4000))
    _reject(body, "out of range")


def test_rejects_duplicate_index():
    body = _body()
    _set_indices(body, lambda idx: idx.__setitem__(1, idx[0]))
    _reject(body, "duplicated")


def test_rejects_non_finite_table_and_values():
    body = _body()
    body["t"][0][3] = np.array([0, float("nan"), 0, 0, 0], dtype="<f4").tobytes()
    _reject(body, "NaN or inf")
    body = _body()
    body["t"][2][3] = np.array([0, 0, 0, 0, float("inf")], dtype="<f4").tobytes()
    _reject(body, "NaN or inf")
    body = _body(_compressed(quant_bits=None))
    vals = np.frombuffer(body["val"], dtype="<f4").copy()
    vals[5] = float("inf")
    body["val"] = vals.tobytes()
    _reject(body, "NaN or inf")
    body = _body(_compressed(quant_bits=None), "entropy")
    zstd, blob = body["val"]
    vals = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob) if zstd else blob, dtype="<f4").copy()
    vals[0] = float("nan")
    body["val"] = [False, vals.tobytes()]
    _reject(body, "NaN or inf")


def test_rejects_overflowing_reconstruction():
    body = _body()
    big = float(np.finfo(np.float32).max)
    body["t"][0][3] = np.array([big, big, big, big, big], dtype="<f4").tobytes()
    _reject(body, "overflow")


def test_rejects_wrong_names_and_shapes():
    data = encode_shard(_compressed())
    wrong_shape = dict(SHAPES, **{"blocks.0.attn.wq.weight": (128, 128)})
    _reject(data, "stream", wrong_shape)
    renamed = {("x" if n == "blocks.0.scale" else n): s for n, s in SHAPES.items()}
    _reject(data, "unexpected tensor", renamed)
    _reject(data, "tensors, expected", dict(SHAPES, extra=(4,)))
    body = _body()
    body["t"][1][0] = body["t"][0][0]
    _reject(body, "repeats")


def test_rejects_framing_errors():
    data = encode_shard(_compressed(), "entropy")
    _reject(data[:-1], "msgpack")
    _reject(data + b"\x00", "msgpack")
    _reject(data, "exceeds", limits=ShardLimits(max_bytes=len(data) - 1))
    _reject(data, "k = 64", limits=ShardLimits(k=32))
    _reject(data, "not accepted", limits=ShardLimits(formats=("packed12",)))
    body = _body()
    body["v"] = 2
    _reject(body, "version")
    body = _body()
    del body["idx"]
    _reject(body, "lacks field")
    body = _body()
    body["t"][0][1] = True
    _reject(body, "k must be")
    body = _body()
    body["idx"] = body["idx"] + b"\x00"
    _reject(body, "bytes, expected")
    _reject(msgpack.packb([1, 2]), "map")


def test_rejects_unquantized_when_not_allowed():
    data = encode_shard(_compressed(quant_bits=None))
    _reject(data, "not accepted", limits=ShardLimits(allow_unquantized=False))


def test_rejects_bad_entropy_streams():
    body = _body(fmt="entropy")
    body["low"] = body["low"][:-1]
    _reject(body, "low-bits")
    body = _body(fmt="entropy")
    body["una"] = [False, b"\x01" * 10_000_000]
    _reject(body, "longer than any valid")
    body = _body(fmt="entropy")
    body["t"][0][2] = 13
    _reject(body, "Rice parameter")


def test_rejects_zstd_bomb():
    body = _body(fmt="entropy")
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * 50_000_000)
    body["val"] = [True, bomb]
    _reject(body, "declares")
    body["val"] = [True, b"\x28\xb5\x2f\xfd garbage"]
    _reject(body, "zstd")


def _check_any(data: bytes, expected: dict = SHAPES) -> None:
    try:
        out = decode_shard(data, expected)
    except ProtocolError:
        return
    for name, shape in expected.items():
        assert out[name].shape == shape and bool(torch.isfinite(out[name]).all())


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data):
    _check_any(data)


VALID = {
    fmt: encode_shard(_compressed({"a": (100, 48), "b": (700,)}, k=64), fmt)
    for fmt in ("packed12", "entropy")
}
SMALL = {"a": (100, 48), "b": (700,)}


@FUZZ
@given(fmt=st.sampled_from(sorted(VALID)), pos=st.integers(0, 10**6), value=st.integers(0, 255))
def test_fuzz_byte_mutations(fmt, pos, value):
    data = bytearray(VALID[fmt])
    data[pos % len(data)] = value
    _check_any(bytes(data), SMALL)


@FUZZ
@given(
    fmt=st.sampled_from(sorted(VALID)),
    pos=st.integers(0, 10**6),
    bit=st.integers(0, 7),
    cut=st.integers(0, 40),
)
def test_fuzz_flips_and_cuts(fmt, pos, bit, cut):
    data = bytearray(VALID[fmt])
    data[pos % len(data)] ^= 1 << bit
    _check_any(bytes(data[: len(data) - cut]), SMALL)
    _check_any(bytes(data) + bytes(cut), SMALL)


@pytest.mark.parametrize("fmt", ["packed12", "entropy"])
def test_every_truncation_is_rejected(fmt):
    data = VALID[fmt]
    for n in range(len(data)):
        with pytest.raises(ProtocolError):
            decode_shard(data[:n], SMALL)
