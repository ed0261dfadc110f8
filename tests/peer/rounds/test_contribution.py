"""Contributions survive the wire exactly, and a frame for another run, round, shard or codec is refused."""

import pytest
import torch

from hlbp.peer.rounds.contribution import contribution_from_bytes, contribution_to_bytes
from hlbp.peer.rounds.outer import OuterConfig, make_outer
from hlbp.protocol import ProtocolError
from hlbp.protocol.sparse import decompress

SHAPES = {"blocks.0.attn.wq.weight": (128, 128), "norm.weight": (128,)}


def _contribution(cfg):
    g = torch.Generator().manual_seed(0)
    anchor = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    local = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in anchor.items()}
    return make_outer(cfg).contribute(anchor, local, "peer-a", 4096)


@pytest.mark.parametrize("fmt", ["entropy", "packed12"])
def test_sparse_round_trip_is_exact(fmt):
    cfg = OuterConfig(k=64)
    c = _contribution(cfg)
    data = contribution_to_bytes(c, cfg, "run1", 7, 2, index_format=fmt)
    back = contribution_from_bytes(data, cfg, SHAPES, run="run1", round=7, shard=2)
    assert back.sender == "peer-a" and back.tokens == 4096
    for n in SHAPES:
        assert torch.equal(decompress(back.tensors[n]), decompress(c.tensors[n]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dense_round_trip(dtype):
    cfg = OuterConfig(kind="diloco", wire_dtype=dtype)
    c = _contribution(cfg)
    back = contribution_from_bytes(contribution_to_bytes(c, cfg, "run1", 1, 0), cfg, SHAPES)
    for n in SHAPES:
        assert torch.equal(back.tensors[n], c.tensors[n].float())


@pytest.mark.parametrize(
    "expect",
    [{"run": "other"}, {"round": 8}, {"shard": 0}],
)
def test_wrong_round_run_or_shard_is_refused(expect):
    cfg = OuterConfig(k=64)
    data = contribution_to_bytes(_contribution(cfg), cfg, "run1", 7, 2)
    with pytest.raises(ProtocolError):
        contribution_from_bytes(data, cfg, SHAPES, **{"run": "run1", "round": 7, "shard": 2, **expect})


def test_codec_other_than_the_runs_is_refused():
    data = contribution_to_bytes(_contribution(OuterConfig(k=64)), OuterConfig(k=64), "r", 1, 0)
    with pytest.raises(ProtocolError):
        contribution_from_bytes(data, OuterConfig(k=128), SHAPES)
    with pytest.raises(ProtocolError):
        contribution_from_bytes(data, OuterConfig(kind="diloco"), SHAPES)
    with pytest.raises(ProtocolError):
        contribution_from_bytes(data, OuterConfig(k=64), {"other": (4,)})


@pytest.mark.parametrize("kind", ["sparseloco", "diloco"])
def test_small_zstd_frame_claiming_a_huge_body_is_refused_before_decompressing(kind):
    """A 33 KB envelope whose valid zstd frame holds 1 GiB once reached 2 GiB resident and seconds of CPU."""
    import resource
    import time

    import zstandard

    from hlbp.protocol import envelope as env

    cfg = OuterConfig(kind=kind)
    data = contribution_to_bytes(_contribution(cfg), cfg, "run1", 7, 2)
    head_len = env.header_length(data[: env.PREFIX_SIZE])
    fields = env.msgpack.unpackb(data[env.PREFIX_SIZE : env.PREFIX_SIZE + head_len])
    sink = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=1 << 30)
    bomb = b"".join(sink.compress(bytes(1 << 20)) for _ in range(1024)) + sink.flush()
    fields.update(enc="zstd", len=len(bomb), raw_len=1 << 30)
    head = env.msgpack.packb(fields, use_bin_type=True)
    forged = env.PREFIX.pack(env.MAGIC, env.ENVELOPE_VERSION, len(head)) + head + bomb
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(ProtocolError, match=f"envelope body of {1 << 30} bytes exceeds the limit of"):
        contribution_from_bytes(forged, cfg, SHAPES)
    assert time.perf_counter() - t0 < 0.1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 32 << 10  # KiB


def test_small_tensor_rule_sends_norms_whole_and_each_side_refuses_the_other():
    """Under ``small_tensors = "dense"`` a norm weight travels whole (2-bit) and a matrix keeps k; the rule is part
    of the codec, so a receiver refuses a payload built under the other rule even when its header lies about it."""
    from hlbp.protocol.shard import max_shard_size
    from hlbp.protocol.sparse import CHUNK_SIZE, tensor_k, transmitted_fraction

    assert tensor_k((128,), 64, "dense") == CHUNK_SIZE and tensor_k((128,), 64, "topk") == 64
    assert tensor_k((64, 64), 64, "dense") == CHUNK_SIZE and tensor_k((128, 128), 64, "dense") == 64
    assert tensor_k((8192,), 64, "dense") == CHUNK_SIZE  # every 1-D tensor, whatever its length
    assert transmitted_fraction((128,), 64, "topk") == 2 / 128 and transmitted_fraction((128,), 64, "dense") == 1.0
    with pytest.raises(ValueError):
        tensor_k((128,), 64, "all")
    dense, topk = OuterConfig(k=64, small_tensors="dense"), OuterConfig(k=64)
    c = _contribution(dense)
    assert c.tensors["norm.weight"].nnz == 128 and c.tensors["blocks.0.attn.wq.weight"].nnz == 4 * 64
    data = contribution_to_bytes(c, dense, "r", 1, 0)
    assert len(data) < max_shard_size(SHAPES, 64, 2, "dense") and max_shard_size(SHAPES, 64) < max_shard_size(SHAPES, 64, 2, "dense")
    back = contribution_from_bytes(data, dense, SHAPES)
    for n in SHAPES:
        assert torch.equal(decompress(back.tensors[n]), decompress(c.tensors[n]))
    with pytest.raises(ProtocolError, match="norm.weight: k = 4096"):  # header names the rule; the body is checked
        contribution_from_bytes(data, topk, SHAPES)
    plain = _contribution(topk)
    with pytest.raises(ProtocolError, match="codec"):  # a topk payload under a dense run's header is refused
        contribution_from_bytes(contribution_to_bytes(plain, topk, "r", 1, 0), dense, SHAPES)
    forged = contribution_to_bytes(plain, dense, "r", 1, 0)  # topk body, header claiming the dense rule
    with pytest.raises(ProtocolError, match="norm.weight: k = 64"):
        contribution_from_bytes(forged, dense, SHAPES)
