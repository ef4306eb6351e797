"""The train and held-out splits of ``cfg.data``, as indexable row sets the trainer's sampler reads.

``open_splits(data_cfg, model_cfg) -> Splits``: ``train`` and ``val`` are
:class:`Rows` (``len``, ``read(rows)``, ``decode(raw)``, ``collate(samples)``:
what ``toolkit.data.MicroBatches`` samples, shards over the data ranks and
runs as data-pipeline actors); ``summary`` says what was skipped as
malformed; ``bayes(rows)`` gives the planted model's true click
probabilities of held-out rows (synthetic data only, else ``None``).

- ``synthetic``: rows ``[0, train_rows)`` of the planted data set train,
  the next ``val_rows`` are held out (encoded and written once under
  ``data.cache_dir``, ``planted_cache.ensure``);
- ``criteo_tsv`` / ``criteo_parquet``: the files of ``data.path`` (a file, a
  directory's files in name order, or a glob) in order; the last
  ``val_fraction`` of their well-formed rows is held out (Criteo is in time
  order: the held-out split is the latest traffic).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .config import hasher
from .criteo_parquet import CriteoParquet
from .criteo_tsv import CriteoTSV
from .features import Encoder
from .planted_cache import Encoded, ensure
from .synthetic import PlantedCriteo


class Rows:
    """A view of ``source`` rows ``[start, stop)``; ``collate`` is ``encoder``'s, or, without one (a source
    whose rows are encoded already), the samples as they are."""

    def __init__(self, source, encoder: Optional[Encoder], start: int, stop: int):
        self.source, self.encoder, self.start, self.stop = source, encoder, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, rows):
        rows = torch.as_tensor(rows, dtype=torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise IndexError(f"rows {int(rows.min())}..{int(rows.max())} outside this split's {len(self)} rows")
        return self.source.read(rows + self.start)

    def decode(self, raw):
        return self.source.decode(raw)

    def collate(self, samples) -> dict:
        return samples if self.encoder is None else self.encoder.collate(samples)

    def load(self, rows) -> dict:
        """``collate(decode(read(rows)))``: the batch of ``rows`` without actors (evaluation)."""
        return self.collate(self.decode(self.read(rows)))


class Synthetic:
    """The planted rows with the ``read``/``decode`` of the file readers: ``read`` gathers the rows from the
    cache ``planted_cache.ensure`` wrote once (memory-mapped, encoded already), ``decode`` hands the batch
    on."""

    def __init__(self, encoded: Encoded):
        self.encoded = encoded

    def __len__(self) -> int:
        return len(self.encoded)

    def read(self, rows) -> dict:
        return self.encoded.read(rows)

    def decode(self, batch: dict) -> dict:
        return batch


@dataclass
class Splits:
    train: Rows
    val: Rows
    summary: str
    bayes: Optional[Callable] = None


def files_of(path: str) -> list:
    """The files ``path`` names: itself, a directory's regular files in name order, or a glob's matches."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        found = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if os.path.isfile(os.path.join(path, f)) and not f.startswith("."))
    elif any(c in path for c in "*?["):
        found = sorted(glob.glob(path))
    else:
        found = [path] if os.path.isfile(path) else []
    if not found:
        raise FileNotFoundError(f"data.path={path!r} names no file (give a file, a directory or a glob)")
    return found


def open_splits(data, model) -> Splits:
    encoder = Encoder(hasher(model))
    if data.source == "synthetic":
        n_train, n_val = int(data.train_rows), int(data.val_rows)
        planted = PlantedCriteo(n_train + n_val, seed=int(data.seed), max_cardinality=int(data.max_cardinality))
        source = Synthetic(Encoded(ensure(planted, encoder, str(data.cache_dir))))

        def bayes(rows):
            return planted.generate(torch.as_tensor(rows) + n_train)["prob"]

        return Splits(Rows(source, None, 0, n_train), Rows(source, None, n_train, n_train + n_val),
                      "synthetic rows: none malformed", bayes)
    files = files_of(str(data.path))
    if data.source == "criteo_tsv":
        source = CriteoTSV(files, str(data.cache_dir), int(data.max_wrong_columns))
    elif data.source == "criteo_parquet":
        source = CriteoParquet(files)
    else:
        raise ValueError(f"data.source={data.source!r} is not one of ('synthetic', 'criteo_tsv', 'criteo_parquet')")
    n = len(source)
    n_val = max(2, int(round(n * float(data.val_fraction))))
    if n_val >= n:
        raise ValueError(f"{n} well-formed rows in {data.path}: too few for a held-out split of "
                         f"val_fraction={data.val_fraction}")
    return Splits(Rows(source, encoder, 0, n - n_val), Rows(source, encoder, n - n_val, n), source.summary())
