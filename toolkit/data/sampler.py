"""Which sequences each training step reads: a deterministic, resumable global-batch order.

``GlobalBatchSampler(n_sequences, global_batch, seed).rows(step)`` is the
global batch of step ``step``: the sequence indices, over all data-parallel
ranks and gradient-accumulation micro-batches together. Epoch ``e`` is a
fresh permutation of ``range(n_sequences)`` drawn from ``(seed, e)``; it is
cut into ``steps_per_epoch = n_sequences // global_batch`` batches and its
last ``n_sequences % global_batch`` sequences are skipped, so no batch
straddles two epochs and no sequence repeats within an epoch. The rows are
a function of ``(seed, step)`` alone: resuming at step ``k`` needs no replay
of steps ``0..k-1``, and every rank computes the same rows without
communicating.

``micro_batch_rows`` is the share of one rank for one micro-batch. Micro-batch
``j`` of ``accum`` is ``rows.tensor_split(accum)[j]`` and rank ``r`` of
``dp_size`` reads ``tensor_split(dp_size)[r]`` of it: the ``S(0)`` layout of
each micro-batch over the data-parallel mesh axis (the first ``n % p``
shares hold one row more), so over all micro-batches and ranks the shares
are exactly the global batch, each row once.

Permutations come from ``torch.randperm`` with a CPU generator, so they are
identical on every machine running the same torch version.
"""
from __future__ import annotations

import hashlib

import torch


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _index(name: str, value, size: int, size_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{name} must be an int in [0, {size_name}={size}), got {value!r}")
    return value


class GlobalBatchSampler:
    """The global rows of every step; ``step`` is the position ``next()`` serves.

    ``rows(step)``: int64 ``[global_batch]`` sequence indices in
    ``[0, n_sequences)``, distinct within an epoch. ``next()``:
    ``rows(self.step)`` and advance. ``state_dict()``/``load_state_dict``
    save and restore the position (plus the arguments, checked on load).
    """

    def __init__(self, n_sequences: int, global_batch: int, seed: int = 0, step: int = 0):
        self.n_sequences = _positive("n_sequences", n_sequences)
        self.global_batch = _positive("global_batch", global_batch)
        if global_batch > n_sequences:
            raise ValueError(f"global_batch={global_batch} exceeds n_sequences={n_sequences}: "
                             "not one batch per epoch; use more data or a smaller batch")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self.steps_per_epoch = n_sequences // global_batch
        self.step = self._step(step)
        self._cached = (None, None)  # (epoch, permutation): one tuple, swapped atomically across threads

    @staticmethod
    def _step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return step

    def epoch_of(self, step: int) -> int:
        return self._step(step) // self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of ``range(n_sequences)`` in epoch ``epoch`` (int64)."""
        cached_epoch, perm = self._cached
        if cached_epoch == epoch:
            return perm
        digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        perm = torch.randperm(self.n_sequences, generator=gen)
        self._cached = (epoch, perm)
        return perm

    def rows(self, step: int) -> torch.Tensor:
        """The global batch of ``step``: ``global_batch`` sequence indices (int64)."""
        epoch, k = divmod(self._step(step), self.steps_per_epoch)
        return self.permutation(epoch)[k * self.global_batch:(k + 1) * self.global_batch].clone()

    def next(self) -> torch.Tensor:
        rows = self.rows(self.step)
        self.step += 1
        return rows

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "n_sequences": self.n_sequences,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; ``ValueError`` if seed/sizes differ from this sampler's."""
        for name in ("seed", "n_sequences", "global_batch"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(f"sampler state has {name}={state[name]!r} but this sampler has "
                                 f"{name}={getattr(self, name)!r}; the rows would differ")
        self.step = self._step(state["step"])

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(n_sequences={self.n_sequences}, global_batch={self.global_batch}, "
                f"seed={self.seed}, step={self.step})")


def micro_batch_rows(rows: torch.Tensor, accum: int, micro: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """The rows data-parallel rank ``dp_rank`` loads for micro-batch ``micro`` of ``accum``.

    ``rows.tensor_split(accum)[micro].tensor_split(dp_size)[dp_rank]``; may be
    empty when ``len(rows) < accum * dp_size``.
    """
    _positive("accum", accum)
    _positive("dp_size", dp_size)
    _index("micro", micro, accum, "accum")
    _index("dp_rank", dp_rank, dp_size, "dp_size")
    if rows.dim() != 1:
        raise ValueError(f"rows must be 1-d, got shape {tuple(rows.shape)}")
    return rows.tensor_split(accum)[micro].tensor_split(dp_size)[dp_rank]
