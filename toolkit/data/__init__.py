"""Data for any recipe: which rows each step reads, and a rank's micro-batches as data-pipeline actors.

- ``sampler``: the deterministic, resumable global batch of each step and
  one rank's share of a micro-batch;
- ``batches``: a rank's micro-batches as data-pipeline actors or plain calls,
  over any indexable sample source (``read``/``decode``/``collate``);
- ``read_ahead``: micro-batches loading on worker threads ahead of the step
  that reads them (on by default where the step runs on a GPU);
- ``build_once``: a cached artifact built by one process, safe under
  concurrent callers.

A recipe's own formats live with it (GPT-2's corpora and token files in
``recipes/gpt2/data``, InsightFace's face records, Wide&Deep's Criteo).
"""
from .batches import MicroBatches, read_ahead_threads
from .read_ahead import ReadAhead
from .sampler import GlobalBatchSampler, micro_batch_rows

__all__ = ["GlobalBatchSampler", "micro_batch_rows", "MicroBatches", "ReadAhead", "read_ahead_threads"]
