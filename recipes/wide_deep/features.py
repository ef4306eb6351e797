"""From raw Criteo columns to the model's fields: ``dense``, ``ids``, ``label``.

A sample is ``(label, dense counts, categorical keys)``: ``label`` 0/1,
``N_DENSE`` counts (missing = 0) and ``N_FIELDS`` 64-bit keys of the raw
categorical values (``hashing.value_key``). ``Encoder.collate`` turns a list
of samples, or :class:`Columns` (the same samples as three arrays, from a
reader that makes whole arrays: no Python object per row), into the batch
the model reads:

- ``dense``: float32 ``[n, N_DENSE]``, ``sign(x) * log1p(|x|)`` of the counts
  (Criteo's counts are heavy-tailed, a few are negative);
- ``ids``: int64 ``[n, N_FIELDS]`` table rows (``FeatureHasher``);
- ``label``: float32 ``[n]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .hashing import FeatureHasher

N_DENSE, N_FIELDS = 13, 26
FIELDS = ("dense", "ids", "label")


def dense_transform(counts: torch.Tensor) -> torch.Tensor:
    counts = counts.to(torch.float64)
    return (torch.sign(counts) * torch.log1p(counts.abs())).to(torch.float32)


@dataclass
class Columns:
    """Samples as columns: ``label [n]``, ``dense [n, N_DENSE]`` counts, ``keys [n, N_FIELDS]`` raw keys."""

    label: np.ndarray
    dense: np.ndarray
    keys: np.ndarray

    def __len__(self) -> int:
        return len(self.label)


class Encoder:
    """Samples -> ``{"dense", "ids", "label"}`` tensors (see the module docstring)."""

    def __init__(self, hasher: FeatureHasher, n_dense: int = N_DENSE):
        self.hasher, self.n_dense = hasher, n_dense

    def spec(self) -> dict:
        """What the encoding of a sample depends on (a cache of encoded rows is keyed by it)."""
        h = self.hasher
        return {"n_dense": self.n_dense, "n_fields": h.n_fields, "sizes": h.sizes.tolist(),
                "offsets": h.offsets.tolist(), "salts": h.salts.tolist()}

    def encode(self, label, dense, keys) -> dict:
        """Arrays ``[n]``, ``[n, n_dense]``, ``[n, n_fields]`` (uint64 keys or raw values) -> the batch."""
        return {"dense": dense_transform(torch.as_tensor(np.asarray(dense, dtype=np.float64)).reshape(-1, self.n_dense)),
                "ids": self.hasher(keys).reshape(-1, self.hasher.n_fields),
                "label": torch.as_tensor(np.asarray(label, dtype=np.float32)).reshape(-1)}

    def collate(self, samples) -> dict:
        if isinstance(samples, Columns):
            return self.encode(samples.label, samples.dense, samples.keys)
        if not samples:
            return self.encode(np.zeros(0), np.zeros((0, self.n_dense)),
                               np.zeros((0, self.hasher.n_fields), dtype=np.uint64))
        labels, dense, keys = zip(*samples)
        return self.encode(np.asarray(labels), np.asarray(dense, dtype=np.float64),
                           np.asarray(keys, dtype=np.uint64))
