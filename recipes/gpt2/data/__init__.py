"""GPT-2's data: corpus -> tokenizer -> token files -> fixed-length sequences.

- ``corpus``: documents from the Python standard library (the default, on
  every machine) or local ``.txt``/``.jsonl``/``.parquet`` files; ``hub``: a
  hub dataset (online only); ``source.open_corpus(source)`` picks one;
- ``tokenizer``: byte-level BPE trained to an exact ``vocab_size`` and cached,
  or an existing ``tokenizer.json``;
- ``prepare``: tokenize once into cached train/validation token files, safe
  under concurrent callers;
- ``tokens``: fixed-length sequences over a memory-mapped token file, the
  sample source ``toolkit.data.MicroBatches`` reads.
"""
from .corpus import Corpus, local_corpus, stdlib_corpus
from .hub import OfflineError, hub_corpus
from .prepare import Prepared, prepare
from .source import open_corpus
from .tokenizer import EOS_TOKEN, TextTokenizer, load_tokenizer, train_tokenizer
from .tokens import TokenSequences, token_dtype

__all__ = [
    "Corpus", "OfflineError", "open_corpus", "stdlib_corpus", "local_corpus", "hub_corpus",
    "EOS_TOKEN", "TextTokenizer", "train_tokenizer", "load_tokenizer",
    "Prepared", "prepare", "TokenSequences", "token_dtype",
]
