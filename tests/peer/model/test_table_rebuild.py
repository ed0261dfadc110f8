"""``ActivationCodec.rebuild_table``: after a round, a stage peer rebuilds T_fixed from the synchronized embedding
(B, A+drift) and two peers that rebuild from the same embedding decode each other's frames exactly."""

from __future__ import annotations

import pytest
import torch

from hlbp.peer.model.basis import fixed_table
from hlbp.peer.model.codec import CodecConfig
from hlbp.peer.model.subspace import anchor_table, make_codec

D, VOCAB, SEQ = 32, 50, 8


def _codec(kind: str, embed: torch.Tensor):
    cfg = CodecConfig(kind=kind, rank="4", seed=9)
    base = fixed_table(VOCAB, D, 9) if kind in ("subspace-a", "subspace-a-drift") else None
    return make_codec(cfg, D, VOCAB, SEQ, base, embed)


@pytest.mark.parametrize("kind", ["subspace-b", "subspace-a-drift"])
def test_b_and_drift_tables_follow_the_embedding_identically_on_both_sides(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    seed_embed = torch.randn(VOCAB, D, generator=g)
    sender, receiver = _codec(kind, seed_embed), _codec(kind, seed_embed)
    synced = seed_embed + 0.1 * torch.randn(VOCAB, D, generator=g)  # the embedding after an outer step
    assert sender.rebuild_table(synced) and receiver.rebuild_table(synced.clone())
    base = fixed_table(VOCAB, D, 9) if kind == "subspace-a-drift" else None
    assert torch.equal(sender.table, anchor_table(kind, base, synced, sender.basis))
    assert sender.table_digest() == receiver.table_digest() != _codec(kind, seed_embed).table_digest()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    h = torch.randn(2, SEQ, D, generator=g)
    out = receiver.decode_forward(sender.encode_forward(h, ids), (2, SEQ)).tensor
    assert torch.allclose(out, sender.expand(sender.compress(h, ids), ids), atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "subspace-a"])
def test_dense_and_a_keep_their_tables(kind: str) -> None:
    embed = torch.randn(VOCAB, D)
    codec = _codec(kind, embed)
    before = getattr(codec, "table", None)
    before = before.clone() if before is not None else None
    assert not codec.rebuild_table(embed + 1.0)
    if before is not None:
        assert torch.equal(codec.table, before)
