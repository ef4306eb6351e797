"""Byte-level BPE tokenizers: trained on a corpus to an exact vocabulary size, cached on disk.

``train_tokenizer(corpus, vocab_size, cache_dir)`` trains GPT-2-style
byte-level BPE (``tokenizers``: a ``BPE`` model, ``ByteLevel`` pre-tokenizer
and decoder, all 256 bytes in the initial alphabet, so any text encodes and
decodes back exactly) with one special token, ``<|endoftext|>`` (id 0), the
document separator. The result has exactly ``vocab_size`` ids: when training
runs out of merges first (a small corpus), unused special tokens
``<|unused_i|>`` fill the remaining ids, so the model's embedding size is the
configured value (tensor parallelism must divide it) and every id is valid.

The tokenizer is cached under ``cache_dir/tokenizer-<key>/tokenizer.json``
with ``key`` a digest of (corpus identity, vocab_size); the next call with
the same corpus and size loads it instead of training. Concurrent callers
train once (``build_once``).

``load_tokenizer(path)`` loads any existing ``tokenizer.json`` (or a
directory holding one, e.g. a local Hugging Face GPT-2 checkout).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from toolkit.data.build_once import build_once, content_key
from .corpus import Corpus

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
MIN_VOCAB_SIZE = 256 + 1  # every byte plus the end-of-text token
TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the few operations the data layer needs.

    ``vocab_size``: number of ids including special tokens (every id is
    below it). ``eos_id``: the document separator's id (the first of
    ``EOS_CANDIDATES`` the vocabulary has), or None. ``path``: the
    ``tokenizer.json`` it was loaded from. ``digest``: sha256 of that file's
    bytes, i.e. its exact identity.

    Text is encoded as text only: a literal ``"<|endoftext|>"`` inside a
    document becomes ordinary tokens, never a special id, so the separator
    appears exactly where ``prepare`` puts it, between documents.
    """

    def __init__(self, tokenizer: Tokenizer, path: str):
        tokenizer.encode_special_tokens = True
        self.tokenizer, self.path = tokenizer, path
        with open(path, "rb") as f:
            self.digest = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for i in map(tokenizer.token_to_id, EOS_CANDIDATES) if i is not None), None)

    def encode(self, text: str) -> list:
        """The ids of ``text`` (no special tokens added or matched)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list) -> list:
        """``[encode(t) for t in texts]``, computed in parallel by ``tokenizers``."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """The text of ``ids`` (a list or 1-d tensor); special tokens are kept as their text."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, path={self.path!r})"


def load_tokenizer(path: str) -> TextTokenizer:
    """A ``tokenizer.json`` file, or a directory containing one, as a ``TextTokenizer``."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer file at {path!r}; give a {TOKENIZER_FILE} path or a directory holding one")
    return TextTokenizer(Tokenizer.from_file(path), path)


def tokenizer_of_weights(path: str) -> str | None:
    """The ``tokenizer.json`` that weights at ``path`` were trained with, or ``None`` when none is found.

    ``path``: a Hugging Face model directory (its own ``tokenizer.json``), or
    one of our checkpoints (a step directory or a checkpoint root): the copy
    a GPT-2 run keeps in its run directory, or ``convert_hf.py import`` in
    its checkpoint root, in the nearest parent, at most four up, stopping at
    the run directory (the first holding ``config.yaml``).
    """
    d = os.path.abspath(os.path.expanduser(path))
    for _ in range(5):
        if os.path.isfile(os.path.join(d, TOKENIZER_FILE)):
            return os.path.join(d, TOKENIZER_FILE)
        if os.path.isfile(os.path.join(d, "config.yaml")):
            return None
        d = os.path.dirname(d)
    return None


def _check_vocab_size(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN}), got {vocab_size!r}")
    return vocab_size


def tokenizer_dir(corpus: Corpus, vocab_size: int, cache_dir: str) -> str:
    """Where ``train_tokenizer(corpus, vocab_size, cache_dir)`` keeps its result."""
    key = content_key({"format": 1, "corpus": corpus.identity, "vocab_size": vocab_size})
    return os.path.join(os.path.abspath(cache_dir), f"tokenizer-{key}")


def train_bpe(documents, vocab_size: int) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` trained on ``documents`` with exactly ``vocab_size`` ids."""
    vocab_size = _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab_size:
        tok.add_special_tokens([f"<|unused_{i}|>" for i in range(vocab_size - have)])
    have = tok.get_vocab_size(with_added_tokens=True)
    ids = sorted(tok.get_vocab(with_added_tokens=True).values())
    if have != vocab_size or ids != list(range(vocab_size)):
        raise RuntimeError(f"trained tokenizer has {have} ids (max {ids[-1]}), expected exactly 0..{vocab_size - 1}")
    return tok


def train_tokenizer(corpus: Corpus, vocab_size: int, cache_dir: str) -> TextTokenizer:
    """The byte-level BPE tokenizer of ``corpus`` with exactly ``vocab_size`` ids, trained once and cached."""
    vocab_size = _check_vocab_size(vocab_size)
    final = tokenizer_dir(corpus, vocab_size, cache_dir)

    def build(tmp: str) -> None:
        log.info("training a %d-token byte-level BPE tokenizer on %s", vocab_size, corpus.description)
        train_bpe(corpus.documents(), vocab_size).save(os.path.join(tmp, TOKENIZER_FILE))
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"corpus": corpus.description, "corpus_identity": corpus.identity,
                       "max_bytes": corpus.max_bytes, "vocab_size": vocab_size}, f, indent=1)

    build_once(final, build)
    return load_tokenizer(os.path.join(final, TOKENIZER_FILE))
