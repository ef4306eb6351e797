"""A small file-backed token dataset for the data-pipeline benchmark and tests: fixed-length sequences of
token ids stored as raw int32/uint16 bytes, read with ``seek``/``read`` and decoded with
``torch.frombuffer`` (random access, no pickles, no numpy), batched by the runtime's data stages."""
from __future__ import annotations

import os

import torch

from runtime.data_pipeline import data_stages


def write_tokens(path: str, tokens: torch.Tensor, dtype=torch.int32) -> None:
    """Write a ``[N, T]`` tensor of token ids to ``path`` as raw ``dtype`` bytes, row-major."""
    t = tokens.to(dtype).contiguous()
    with open(path, "wb") as f:
        f.write(bytes(t.untyped_storage())[: t.numel() * t.element_size()])


class TokenFile:
    """Batches of fixed-length token sequences read from a raw binary file.

    The file holds ``N`` sequences of ``seq_len`` ids of ``dtype`` (int32 or
    uint16), back to back. Batch ``piece`` is sequences
    ``[b * batch_size, (b + 1) * batch_size)`` with ``b = piece % len(self)``
    (so a run may loop over the file). ``read``/``decode``/``collate`` have the
    actor signatures of ``data_stages``; ``self[piece]`` does all three (for a
    map-style ``torch.utils.data.Dataset`` with ``batch_size=None``). The file
    handle is opened lazily per process, so the object pickles to workers.
    """

    def __init__(self, path: str, seq_len: int, batch_size: int, dtype=torch.int32):
        if dtype not in (torch.int32, torch.uint16):
            raise ValueError(f"dtype must be torch.int32 or torch.uint16, got {dtype}")
        self.path, self.seq_len, self.batch_size, self.dtype = path, seq_len, batch_size, dtype
        self.seq_bytes = seq_len * torch.empty((), dtype=dtype).element_size()
        n_seq = os.path.getsize(path) // self.seq_bytes
        self.n_batches = n_seq // batch_size
        if self.n_batches < 1:
            raise ValueError(f"{path}: {n_seq} sequences of {seq_len} tokens, fewer than one batch of {batch_size}")
        self._file, self._pid = None, None

    def __len__(self) -> int:
        return self.n_batches

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_pid": None}

    def _handle(self):
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb", buffering=0), os.getpid()
        return self._file

    def read(self, piece: int) -> bytearray:
        """The raw bytes of batch ``piece``'s sequences (they are contiguous: one seek and one read
        into a fresh writable buffer, which ``decode`` views without copying)."""
        f, first = self._handle(), (piece % self.n_batches) * self.batch_size
        size = self.batch_size * self.seq_bytes
        f.seek(first * self.seq_bytes)
        raw = bytearray(size)
        got = f.readinto(raw)
        if got != size:
            raise IOError(f"{self.path}: short read of batch {piece}: {got} of {size} bytes")
        return raw

    def decode(self, piece: int, raw: bytearray) -> torch.Tensor:
        """The sequences of ``raw`` as int64 token ids, ``[batch_size, seq_len]`` (its rows are the
        samples, already laid out as the batch: ``collate`` copies nothing).

        ``.long()``, not ``.to(torch.int64)``: run between training steps (on
        the compute thread of a CPU-only host) the three calls are cold, and
        ``.to``'s overloads cost ~20 us more to resolve there (in place, 4 runs
        of 60 batches, medians: 55 us against 77 us for the three calls).
        """
        ids = torch.frombuffer(raw, dtype=self.dtype).long()
        return ids.view(self.batch_size, self.seq_len)

    def collate(self, piece: int, samples: torch.Tensor) -> dict:
        """``{"input_ids": [batch_size, seq_len]}`` int64: ``decode``'s tensor itself."""
        return {"input_ids": samples}

    def __getitem__(self, piece: int) -> dict:
        return self.collate(piece, self.decode(piece, self.read(piece)))

    def stages(self, device=None, quota: int = 2, prefix: str = "data") -> list:
        """``data_stages`` over this file's ``read``, ``decode`` and ``collate``."""
        return data_stages(self.read, self.decode, self.collate, device, quota, prefix)
