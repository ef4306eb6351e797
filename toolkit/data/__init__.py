"""Data for language-model recipes: corpus -> tokenizer -> token files -> per-rank micro-batches.

- ``corpus``: ``open_corpus(source)`` streams documents from the Python
  standard library (the default, on every machine), local ``.txt``/
  ``.jsonl``/``.parquet`` files, or a hub dataset (online only);
- ``tokenizer``: byte-level BPE trained to an exact ``vocab_size`` and cached,
  or an existing ``tokenizer.json``;
- ``prepare``: tokenize once into cached train/validation token files, safe
  under concurrent callers;
- ``tokens``: fixed-length sequences over a memory-mapped token file;
- ``sampler``: the deterministic, resumable global batch of each step and
  one rank's share of a micro-batch;
- ``batches``: a rank's micro-batches as data-pipeline actors or plain calls.
"""
from .batches import MicroBatches
from .corpus import Corpus, local_corpus, open_corpus, stdlib_corpus
from .hub import OfflineError, hub_corpus
from .prepare import Prepared, prepare
from .sampler import GlobalBatchSampler, micro_batch_rows
from .tokenizer import EOS_TOKEN, TextTokenizer, load_tokenizer, train_tokenizer
from .tokens import TokenSequences, token_dtype

__all__ = [
    "Corpus", "OfflineError", "open_corpus", "stdlib_corpus", "local_corpus", "hub_corpus",
    "EOS_TOKEN", "TextTokenizer", "train_tokenizer", "load_tokenizer",
    "Prepared", "prepare", "TokenSequences", "token_dtype",
    "GlobalBatchSampler", "micro_batch_rows", "MicroBatches",
]
