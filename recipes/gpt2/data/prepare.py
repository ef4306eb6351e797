"""Tokenize a corpus once into train/validation token files, cached and safe to call from every rank.

``prepare(source, vocab_size, seq_len, val_fraction, cache_dir)`` returns a
``Prepared``: the paths of two flat token files (``train.bin``, ``val.bin``),
the tokenizer they were made with, and their counts. Layout of the cache
entry ``cache_dir/prepared-<key>/``:

- ``train.bin``, ``val.bin``: every document's ids followed by the
  end-of-text id, documents back to back, as raw ``uint16`` when
  ``vocab_size <= 65536`` else ``int32``, native byte order (recorded);
- ``tokenizer.json``: a copy of the tokenizer, so the entry is self-contained;
- ``meta.json``: format, dtype, byteorder, vocab sizes, seq_len, eos id,
  source description and identity, tokenizer digest, val_fraction, seed, and
  per split ``n_tokens``, ``n_documents``, ``n_sequences`` and ``sha256``.

``key`` is a digest of every argument that can change the result (corpus
identity including ``max_bytes`` and ``text_field``, tokenizer digest,
``vocab_size``, ``seq_len``, ``val_fraction``, ``seed``), so a second call
is a cache hit that reads only ``meta.json``. Concurrent callers build once
(``build_once``: a file lock plus write-to-temp-then-rename).

The split is by document, deterministic and streaming: with ``f =
val_fraction`` and a phase ``u`` in ``[0, 1)`` drawn from ``seed``, document
``d`` (0-based, in corpus order) goes to validation iff
``floor((d + 1) f + u) > floor(d f + u)``: exactly ``floor(n f + u)`` of
``n`` documents, spread evenly over the corpus. Documents are tokenized in
batches (``encode_batch``) and written as they come, so memory holds one
batch of documents, never the corpus as Python ints.
"""
from __future__ import annotations

import array
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
from dataclasses import dataclass

import torch

from toolkit.data.build_once import build_once, content_key
from .source import open_corpus
from .tokenizer import TOKENIZER_FILE, TextTokenizer, load_tokenizer, train_tokenizer
from .tokens import DTYPES, TokenSequences, token_dtype

log = logging.getLogger(__name__)

FORMAT = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
BATCH_DOCUMENTS = 512        # documents per encode_batch call ...
BATCH_BYTES = 8 << 20        # ... or fewer, once they hold this many characters
_ARRAY_CODES = {torch.uint16: "H", torch.int32: "i"}


@dataclass(frozen=True)
class Prepared:
    """A finished cache entry of ``prepare``.

    ``train_path``/``val_path``: flat token files of ``dtype``;
    ``vocab_size``: the model's vocabulary size (every id is below it);
    ``tokenizer_path``: the entry's ``tokenizer.json``; ``eos_id``: the
    separator after each document (None if the tokenizer has none);
    ``built``: True iff this call built the entry (False on a cache hit).
    """

    directory: str
    train_path: str
    val_path: str
    tokenizer_path: str
    vocab_size: int
    seq_len: int
    dtype: torch.dtype
    eos_id: int | None
    n_train_tokens: int
    n_val_tokens: int
    n_train_documents: int
    n_val_documents: int
    built: bool = False

    @property
    def n_train_sequences(self) -> int:
        return self.n_train_tokens // self.seq_len

    @property
    def n_val_sequences(self) -> int:
        return self.n_val_tokens // self.seq_len

    def path(self, split: str) -> str:
        """The token file of ``split`` ("train" or "val")."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        return self.train_path if split == "train" else self.val_path

    def tokens(self, split: str = "train") -> TokenSequences:
        """``split``'s sequences of ``seq_len`` tokens."""
        return TokenSequences(self.path(split), self.seq_len, self.dtype)

    def tokenizer(self) -> TextTokenizer:
        return load_tokenizer(self.tokenizer_path)

    def meta(self) -> dict:
        with open(os.path.join(self.directory, META_FILE)) as f:
            return json.load(f)

    def verify(self) -> None:
        """Recompute both files' sha256 and sizes; ``ValueError`` naming the file on a mismatch."""
        meta = self.meta()
        for split in SPLITS:
            expect, path = meta["splits"][split], self.path(split)
            digest, size = hashlib.sha256(), 0
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    size += len(block)
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            if size != expect["n_tokens"] * itemsize or digest.hexdigest() != expect["sha256"]:
                raise ValueError(f"{path}: {size} bytes with sha256 {digest.hexdigest()}, but {META_FILE} "
                                 f"says {expect['n_tokens']} tokens with sha256 {expect['sha256']}")

    @classmethod
    def load(cls, directory: str, built: bool = False) -> "Prepared":
        """The entry in ``directory`` (as ``prepare`` left it), from its ``meta.json``."""
        directory = os.path.abspath(directory)
        with open(os.path.join(directory, META_FILE)) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{directory}: format {meta.get('format')!r}, this code reads format {FORMAT}")
        if meta["byteorder"] != sys.byteorder:
            raise ValueError(f"{directory}: {meta['byteorder']}-endian tokens on a {sys.byteorder}-endian machine")
        train, val = meta["splits"]["train"], meta["splits"]["val"]
        return cls(directory, os.path.join(directory, train["file"]), os.path.join(directory, val["file"]),
                   os.path.join(directory, TOKENIZER_FILE), meta["vocab_size"], meta["seq_len"],
                   DTYPES[meta["dtype"]], meta["eos_id"], train["n_tokens"], val["n_tokens"],
                   train["n_documents"], val["n_documents"], built)


def validation_documents(val_fraction: float, seed: int):
    """``is_val(d) -> bool`` for document index ``d``: the deterministic split described above."""
    phase = random.Random(seed).random()

    def is_val(d: int) -> bool:
        return math.floor((d + 1) * val_fraction + phase) > math.floor(d * val_fraction + phase)

    return is_val


def _batches(documents):
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _SplitWriter:
    def __init__(self, path: str, dtype: torch.dtype):
        self.file, self.code = open(path, "wb"), _ARRAY_CODES[dtype]
        self.sha, self.n_tokens, self.n_documents = hashlib.sha256(), 0, 0

    def write(self, ids: list) -> None:
        data = array.array(self.code, ids).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.n_tokens += len(ids)
        self.n_documents += 1

    def summary(self, name: str, seq_len: int) -> dict:
        self.file.close()
        return {"file": name, "n_tokens": self.n_tokens, "n_documents": self.n_documents,
                "n_sequences": self.n_tokens // seq_len, "sha256": self.sha.hexdigest()}


def _check(name, value, ok, want):
    if isinstance(value, bool) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")


def prepare(source, vocab_size: int, seq_len: int, val_fraction: float, cache_dir: str,
            max_bytes: int | None = None, seed: int = 0, tokenizer: str | None = None,
            text_field: str = "text") -> Prepared:
    """Tokenized train/validation files of ``source`` (see ``open_corpus``), built once and cached.

    ``tokenizer``: None trains (or loads the cached) byte-level BPE of
    exactly ``vocab_size`` ids on the same corpus; a path loads that
    ``tokenizer.json`` (its vocabulary must not exceed ``vocab_size``, which
    may be larger: ids the tokenizer never produces). Raises ``ValueError`` when a split (validation only if
    ``val_fraction > 0``) ends with fewer than ``seq_len`` tokens.
    """
    _check("vocab_size", vocab_size, lambda v: isinstance(v, int) and v >= 2, "an int >= 2")
    _check("seq_len", seq_len, lambda v: isinstance(v, int) and v >= 1, "a positive int")
    _check("val_fraction", val_fraction, lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "a number in [0, 1)")
    _check("seed", seed, lambda v: isinstance(v, int), "an int")
    corpus = open_corpus(source, max_bytes=max_bytes, text_field=text_field)
    cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
    tok = train_tokenizer(corpus, vocab_size, cache_dir) if tokenizer is None else load_tokenizer(tokenizer)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.path!r} has {tok.vocab_size} ids, more than vocab_size={vocab_size}; "
                         f"use vocab_size >= {tok.vocab_size}")
    dtype = token_dtype(vocab_size)
    key = content_key({"format": FORMAT, "corpus": corpus.identity, "tokenizer": tok.digest,
                       "vocab_size": vocab_size, "seq_len": seq_len, "val_fraction": float(val_fraction),
                       "seed": seed})
    final = os.path.join(cache_dir, f"prepared-{key}")

    def build(tmp: str) -> None:
        log.info("tokenizing %s into %s", corpus.description, final)
        is_val = validation_documents(float(val_fraction), seed)
        writers = {s: _SplitWriter(os.path.join(tmp, f"{s}.bin"), dtype) for s in SPLITS}
        tail = [] if tok.eos_id is None else [tok.eos_id]
        d = 0
        for batch in _batches(corpus.documents()):
            for ids in tok.encode_batch(batch):
                writers["val" if is_val(d) else "train"].write(ids + tail)
                d += 1
        splits = {s: writers[s].summary(f"{s}.bin", seq_len) for s in SPLITS}
        for s in SPLITS:
            if (s == "train" or val_fraction > 0) and splits[s]["n_tokens"] < seq_len:
                raise ValueError(f"{corpus.description}: the {s} split has {splits[s]['n_tokens']} tokens "
                                 f"({splits[s]['n_documents']} of {d} documents), fewer than one sequence of "
                                 f"seq_len={seq_len}; use a larger corpus or max_bytes, a smaller seq_len, "
                                 f"or another val_fraction")
        shutil.copyfile(tok.path, os.path.join(tmp, TOKENIZER_FILE))
        meta = {"format": FORMAT, "dtype": {torch.uint16: "uint16", torch.int32: "int32"}[dtype],
                "byteorder": sys.byteorder, "vocab_size": vocab_size, "tokenizer_vocab_size": tok.vocab_size,
                "seq_len": seq_len, "eos_id": tok.eos_id, "source": corpus.description,
                "source_hash": corpus.identity, "max_bytes": corpus.max_bytes, "tokenizer_sha256": tok.digest,
                "val_fraction": float(val_fraction), "seed": seed, "key": key, "splits": splits}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)

    built = build_once(final, build)
    return Prepared.load(final, built=built)
