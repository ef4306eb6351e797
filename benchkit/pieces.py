"""A recipe's micro-batches by piece number, as ``torch.utils.data`` serves them: the peer loaders' side.

Piece ``q`` is micro-batch ``q % accum`` of step ``q // accum`` (the
numbering of ``MicroBatches.read`` and ``toolkit.data.ReadAhead``).
``Pieces`` is a map-style dataset of them, ``Window`` a sampler of the
pieces ``start .. start + n`` whose start moves between iterations, so one
``DataLoader`` with persistent workers serves any run of pieces
(``scripts/bench_read_ahead.py``, ``scripts/bench_data_feed.py``);
``same_batch`` is how those scripts check each way's first batch against
``load``'s.
"""
from __future__ import annotations

import torch


class Pieces(torch.utils.data.Dataset):
    """Piece ``q`` of ``batches`` (micro-batch ``q % accum`` of step ``q // accum``): DataLoader's items."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, q: int):
        return self.batches.load(q // self.batches.accum, q % self.batches.accum)


class Window(torch.utils.data.Sampler):
    """Pieces ``start .. start + n``, both settable between iterations (one loader, persistent workers)."""

    def __init__(self, n: int):
        self.start, self.n = 0, n

    def __iter__(self):
        return iter(range(self.start, self.start + self.n))

    def __len__(self) -> int:
        return self.n


def same_batch(a, b) -> bool:
    """Are batches ``a`` and ``b`` (tensors, or dicts of them) equal, key for key and element for element?"""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_batch(a[k], b[k]) for k in a)
    return torch.equal(a, b)
