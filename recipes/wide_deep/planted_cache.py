"""The planted rows, encoded as the model reads them, written once and gathered: the synthetic data's reader.

``ensure(planted, encoder, cache_dir)`` writes every row of ``planted``
(``synthetic.PlantedCriteo``) through ``encoder`` (``features.Encoder``:
the dense transform and the feature hashing) once, under
``cache_dir/wide_deep``, keyed by the generator's arguments, the encoder's
tables and ``synthetic.VERSION`` (``toolkit.data.build_once``: the ranks of
a job, and later jobs, share one copy; about 260 bytes a row). ``Encoded``
memory-maps it, and ``read(rows)`` is then the batch: three gathers.

Why not generate each batch: a read-ahead thread works beside the step, and
each of its numpy and torch calls may take the GIL while the step's thread
is in a torch op, which then waits to get it back. Generating, transforming
and hashing a batch is over a hundred such calls; on a step that is host
work they cost it about their whole time (``scripts/bench_data_feed.py``).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from toolkit.data.build_once import build_once, content_key

from .features import FIELDS, Encoder
from .synthetic import VERSION, PlantedCriteo

_CHUNK = 1 << 16  # rows generated and encoded at once while writing


def write(planted: PlantedCriteo, encoder: Encoder, directory: str) -> None:
    """Every row of ``planted`` encoded into ``directory``: ``<field>.npy`` for each of ``features.FIELDS``
    (``dense`` float32 ``[n, 13]``, ``ids`` int64 ``[n, 26]``, ``label`` float32 ``[n]``), ``_CHUNK`` rows
    at a time (each row's encoding is its own, so the chunks do not change it)."""
    n, out = len(planted), None
    for start in range(0, n, _CHUNK):
        raw = planted.generate(torch.arange(start, min(start + _CHUNK, n)))
        batch = encoder.encode(raw["label"].numpy(), raw["dense"].numpy(), raw["cats"].numpy())
        if out is None:
            out = {k: np.lib.format.open_memmap(os.path.join(directory, f"{k}.npy"), mode="w+",
                                                dtype=batch[k].numpy().dtype, shape=(n, *batch[k].shape[1:]))
                   for k in FIELDS}
        for k in FIELDS:
            out[k][start:start + len(raw["label"])] = batch[k].numpy()
    for m in out.values():
        m.flush()


def ensure(planted: PlantedCriteo, encoder: Encoder, cache_dir: str) -> str:
    """The directory of ``planted``'s rows encoded by ``encoder`` under ``cache_dir``, written on first use."""
    key = content_key({**planted.params, "encoder": encoder.spec(), "version": VERSION})
    root = os.path.join(os.path.expanduser(cache_dir), "wide_deep", f"synthetic-{key}")
    build_once(root, lambda tmp: write(planted, encoder, tmp))
    missing = [f"{k}.npy" for k in FIELDS if not os.path.isfile(os.path.join(root, f"{k}.npy"))]
    if missing:
        raise FileNotFoundError(f"{root} lacks {missing}: remove the directory so it is written again")
    return root


class Encoded:
    """The rows ``ensure`` wrote, memory-mapped; ``read(rows)`` is their batch (``features.FIELDS``)."""

    def __init__(self, root: str):
        self.root = root
        # ndarray views of the maps: gathering from a plain ndarray skips np.memmap's Python-level indexing
        self.columns = {k: np.asarray(np.load(os.path.join(root, f"{k}.npy"), mmap_mode="r")) for k in FIELDS}
        n = {len(v) for v in self.columns.values()}
        if len(n) != 1:
            raise ValueError(f"{root}: its columns hold different numbers of rows {sorted(n)}: remove the "
                             "directory so it is written again")
        self.n_rows = n.pop()

    def __len__(self) -> int:
        return self.n_rows

    def read(self, rows) -> dict:
        """``{"dense", "ids", "label"}`` of ``rows``: tensors in memory, as ``Encoder.collate`` makes them."""
        r = np.asarray(rows, dtype=np.int64)
        return {k: torch.from_numpy(v[r]) for k, v in self.columns.items()}
