"""Random access to fixed-length sequences of a flat, memory-mapped token file.

The file is ``n_tokens`` ids of one dtype (``torch.uint16`` or
``torch.int32``, native byte order) back to back, as ``prepare`` writes it.
Sequence ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)``; the last
``n_tokens % seq_len`` tokens belong to no sequence. A sequence is both the
input and the label of causal language modelling (the model shifts labels
internally), so no ``+ 1`` token is read.

The file is mapped lazily with ``torch.from_file(shared=False)`` (a private,
read-only-in-practice mapping: pages are read on first touch, nothing is
loaded up front), once per process, so a ``TokenSequences`` pickles to
worker processes cheaply.
"""
from __future__ import annotations

import os

import torch

DTYPES = {"uint16": torch.uint16, "int32": torch.int32}


def token_dtype(vocab_size: int) -> torch.dtype:
    """``torch.uint16`` when every id of ``vocab_size`` fits (``<= 65536``), else ``torch.int32``."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


class TokenSequences:
    """Sequences of ``seq_len`` token ids over the token file at ``path``.

    ``len(self)`` is the number of whole sequences; ``self[i]`` is sequence
    ``i`` as an int64 tensor ``[seq_len]``; ``self.gather(rows)`` is the
    sequences ``rows`` (any 1-d integer tensor or list) as int64
    ``[len(rows), seq_len]``; ``self.read(rows)`` the same in the file's
    dtype (a copy, so the mapping's pages are read here); ``decode`` and
    ``collate`` finish a batch (``toolkit.data.MicroBatches``' sample-source
    protocol): ``{"input_ids": int64 [len(rows), seq_len]}``.
    """

    def __init__(self, path: str, seq_len: int, dtype: torch.dtype = torch.uint16):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES.values())}, got {dtype}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.path, self.seq_len, self.dtype = os.path.abspath(path), seq_len, dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = os.path.getsize(self.path)
        if size % itemsize:
            raise ValueError(f"{self.path}: {size} bytes is not a whole number of {dtype} ids ({itemsize} bytes each)")
        self.n_tokens = size // itemsize
        self.n_sequences = self.n_tokens // seq_len
        if self.n_sequences < 1:
            raise ValueError(f"{self.path}: {self.n_tokens} tokens, fewer than one sequence of {seq_len}")
        self._view, self._pid = None, None

    def __getstate__(self):
        return {**self.__dict__, "_view": None, "_pid": None}

    def _sequences(self) -> torch.Tensor:
        if self._view is None or self._pid != os.getpid():
            flat = torch.from_file(self.path, shared=False, size=self.n_tokens, dtype=self.dtype)
            self._view = flat[: self.n_sequences * self.seq_len].view(self.n_sequences, self.seq_len)
            self._pid = os.getpid()
        return self._view

    def __len__(self) -> int:
        return self.n_sequences

    def _index(self, rows) -> torch.Tensor:
        rows = torch.as_tensor(rows, dtype=torch.int64)
        if rows.dim() != 1:
            raise ValueError(f"rows must be 1-d, got shape {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.n_sequences):
            raise IndexError(f"sequence rows must lie in [0, {self.n_sequences}), got min {int(rows.min())} "
                             f"max {int(rows.max())} ({self.path})")
        return rows

    def read(self, rows) -> torch.Tensor:
        """Sequences ``rows`` in the file's dtype, ``[len(rows), seq_len]`` (a copy)."""
        return self._sequences().index_select(0, self._index(rows))

    def gather(self, rows) -> torch.Tensor:
        """Sequences ``rows`` as int64 token ids, ``[len(rows), seq_len]``."""
        return self.read(rows).to(torch.int64)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """``read``'s rows as int64 token ids, ``[rows, seq_len]``: the samples are its rows, already
        laid out as the batch, so ``collate`` copies nothing (one conversion, none for int64 files)."""
        return raw.to(torch.int64)

    def collate(self, samples) -> dict:
        """``{"input_ids": LongTensor[len(samples), seq_len]}`` (``[0, seq_len]`` for no samples).

        ``samples``: ``decode``'s tensor (taken as it is, no copy) or a list of sequences (stacked)."""
        if isinstance(samples, torch.Tensor):
            return {"input_ids": samples}
        if not samples:
            return {"input_ids": torch.empty(0, self.seq_len, dtype=torch.int64)}
        return {"input_ids": torch.stack(samples)}

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n_sequences <= i < self.n_sequences:
            raise IndexError(f"sequence {i} out of range for {self.n_sequences} sequences ({self.path})")
        return self._sequences()[i].to(torch.int64)

    def __repr__(self) -> str:
        return (f"TokenSequences({self.path!r}, seq_len={self.seq_len}, dtype={self.dtype}, "
                f"n_sequences={self.n_sequences})")
