"""Training data: the BPE tokenizer, the fixed validation split, the token cache and token streams.

Documents come from :mod:`hlbp.peer.data.corpus`; its public names are re-exported here so that callers keep one
import for all of data preparation. Everything is keyed by content so that peers agree without talking: the
corpus by a digest of its documents, the tokenizer by the sha256 of its ``tokenizer.json``, the token arrays
by both. The validation split is a function of document ids alone (never of seed or rank), and a training
batch is a pure function of (seed, rank, step), so a resumed or restarted peer sees exactly the data it would
have seen. Caches are written atomically and verified on load, so a killed process or a damaged file costs a
rebuild, never wrong data.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hlbp.peer.common.errors import UserInputError
from hlbp.peer.common.files import atomic_write_bytes
from hlbp.peer.data.corpus import (
    BUILTIN_PACKAGES,
    CORPUS_VERSION,
    JSON_SUFFIXES,
    SHAKESPEARE,
    TEXT_SUFFIXES,
    WIKI,
    Document,
    builtin_documents,
    clean_text,
    corpus_digest,
    default_cache_dir,
    load_documents,
)

# The public names of data preparation; Document and the loaders are re-exported from hlbp.peer.data.corpus.
__all__ = [
    "BUILTIN_PACKAGES",
    "CORPUS_VERSION",
    "DEFAULT_VOCAB_SIZE",
    "EOT",
    "EOT_CANDIDATES",
    "JSON_SUFFIXES",
    "MIN_VAL_TOKENS",
    "SHAKESPEARE",
    "SPLIT_RECIPE",
    "TEXT_SUFFIXES",
    "TOKENIZER_RECIPE",
    "VAL_FRACTION",
    "WIKI",
    "Document",
    "PreparedData",
    "TokenStream",
    "builtin_documents",
    "clean_text",
    "corpus_digest",
    "default_cache_dir",
    "load_documents",
    "load_tokenizer",
    "prepare_data",
    "split_documents",
    "tokenize_split",
    "tokenizer_hash",
    "train_tokenizer",
    "val_batches",
]

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
# End-of-text spellings accepted in a user's tokenizer.json; the first one present separates documents.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
VAL_FRACTION = 0.02  # share of documents, by id hash, held out for validation
MIN_VAL_TOKENS = 65_536  # enough for 32 batches of 8x256 or 4 of 16x1024
# Bumped whenever tokenizer training or the split rule changes, so stale caches are never reused.
TOKENIZER_RECIPE = "bpe-v1"
SPLIT_RECIPE = "split-v1"


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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
