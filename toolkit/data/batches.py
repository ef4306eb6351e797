"""One rank's micro-batches of a training step, as data-pipeline actors or as a plain call.

``MicroBatches(tokens, sampler, accum, dp_size, dp_rank)`` reads, for step
``s`` and micro-batch ``j``, the sequences
``micro_batch_rows(sampler.rows(s), accum, j, dp_size, dp_rank)`` of
``tokens``: this rank's ``S(0)`` shard of micro-batch ``j`` of the step's
global batch.

Actor use (``runtime.data_pipeline.data_stages``): piece ``k`` is micro-batch
``k % accum`` of step ``self.step + k // accum``, so a run of ``accum``
pieces per step (set ``step`` before the run starts) and a single long run
from ``step`` both read the right rows. ``read(piece)`` copies the rows out
of the token file's mapping (the file I/O) in its dtype, ``decode`` turns
them into int64 sequences, ``collate`` stacks them into
``{"input_ids": LongTensor[b, seq_len]}``; ``b`` is this rank's share of the
micro-batch. Labels are the input ids (GPT-2 shifts them internally).
``stages()`` returns the four actors.

Plain use (evaluation, tests): ``load(step, micro)`` is the same tensor.
"""
from __future__ import annotations

import copy

import torch

from runtime.data_pipeline import data_stages

from .sampler import GlobalBatchSampler, micro_batch_rows
from .tokens import TokenSequences


class MicroBatches:
    """The micro-batches one data-parallel rank reads for each step.

    ``step`` (settable) is the step piece 0 belongs to; ``for_step(s)`` is a
    copy bound to step ``s`` (sharing the token file and sampler), for runs
    that must not see a later change of ``step``.
    """

    def __init__(self, tokens: TokenSequences, sampler: GlobalBatchSampler, accum: int = 1,
                 dp_size: int = 1, dp_rank: int = 0, step: int = 0):
        if sampler.n_sequences > len(tokens):
            raise ValueError(f"sampler draws from {sampler.n_sequences} sequences but {tokens.path} "
                             f"holds {len(tokens)} of {tokens.seq_len} tokens")
        micro_batch_rows(torch.empty(0, dtype=torch.int64), accum, 0, dp_size, dp_rank)  # validates the sizes
        self.tokens, self.sampler = tokens, sampler
        self.accum, self.dp_size, self.dp_rank = accum, dp_size, dp_rank
        self.step = step

    @classmethod
    def from_prepared(cls, prepared, split: str, global_batch: int, seed: int = 0, accum: int = 1,
                      dp_size: int = 1, dp_rank: int = 0, step: int = 0) -> "MicroBatches":
        """Over ``prepared.tokens(split)`` with a ``GlobalBatchSampler(len(tokens), global_batch, seed)``."""
        tokens = prepared.tokens(split)
        return cls(tokens, GlobalBatchSampler(len(tokens), global_batch, seed), accum, dp_size, dp_rank, step)

    @property
    def seq_len(self) -> int:
        return self.tokens.seq_len

    def for_step(self, step: int) -> "MicroBatches":
        other = copy.copy(self)
        other.step = step
        return other

    def rows(self, piece: int) -> torch.Tensor:
        """The global sequence indices piece ``piece`` reads (see the module docstring)."""
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 0:
            raise ValueError(f"piece must be a non-negative int, got {piece!r}")
        step, micro = divmod(piece, self.accum)
        return micro_batch_rows(self.sampler.rows(self.step + step), self.accum, micro,
                                self.dp_size, self.dp_rank)

    def read(self, piece: int) -> torch.Tensor:
        """This rank's rows of piece ``piece``, ``[b, seq_len]`` in the file's dtype."""
        return self.tokens.read(self.rows(piece))

    def decode(self, piece: int, raw: torch.Tensor) -> list:
        """Each row of ``raw`` as an int64 sequence of ``seq_len`` token ids."""
        return list(raw.to(torch.int64).unbind(0))

    def collate(self, piece: int, samples: list) -> dict:
        """``{"input_ids": LongTensor[len(samples), seq_len]}`` (``[0, seq_len]`` for no samples)."""
        if not samples:
            return {"input_ids": torch.empty(0, self.seq_len, dtype=torch.int64)}
        return {"input_ids": torch.stack(samples)}

    def load(self, step: int, micro: int) -> torch.Tensor:
        """``input_ids`` of micro-batch ``micro`` of step ``step`` for this rank, without actors."""
        if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro < self.accum:
            raise ValueError(f"micro must be an int in [0, accum={self.accum}), got {micro!r}")
        batch = self.for_step(step)
        return batch.collate(micro, batch.decode(micro, batch.read(micro)))["input_ids"]

    def stages(self, device=None, quota: int = 2, prefix: str = "data") -> list:
        """``data_stages`` over ``read``, ``decode`` and ``collate`` (consume ``stages[-1].name``)."""
        return data_stages(self.read, self.decode, self.collate, device, quota, prefix)

    def __repr__(self) -> str:
        return (f"MicroBatches({self.tokens!r}, {self.sampler!r}, accum={self.accum}, "
                f"dp_size={self.dp_size}, dp_rank={self.dp_rank}, step={self.step})")
