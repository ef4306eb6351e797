"""The train and held-out splits of ``cfg.data``, as indexable row sets the trainer's sampler reads.

``open_splits(data_cfg, model_cfg) -> Splits``: ``train`` and ``val`` are
:class:`Rows` (``len``, ``read(rows)``, ``decode(raw)``, ``collate(samples)``:
what ``toolkit.data.MicroBatches`` samples, shards over the data ranks and
runs as data-pipeline actors); ``summary`` says what was skipped as
malformed; ``bayes(rows)`` gives the planted model's true click
probabilities of held-out rows (synthetic data only, else ``None``).

- ``synthetic``: rows ``[0, train_rows)`` of the planted data set train,
  the next ``val_rows`` are held out (written once under ``data.cache_dir``,
  ``synthetic.ensure``);
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
from .features import Columns, Encoder
from .synthetic import PlantedColumns, PlantedCriteo, ensure


class Rows:
    """A view of ``source`` rows ``[start, stop)`` with the recipe's encoder as ``collate``."""

    def __init__(self, source, encoder: Encoder, start: int, stop: int):
        self.source, self.encoder, self.start, self.stop = source, encoder, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, rows):
        rows = torch.as_tensor(rows, dtype=torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise IndexError(f"rows {int(rows.min())}..{int(rows.max())} outside this split's {len(self)} rows")
        return self.source.read(rows + self.start)

    def decode(self, raw) -> list:
        return self.source.decode(raw)

    def collate(self, samples: list) -> dict:
        return self.encoder.collate(samples)

    def load(self, rows) -> dict:
        """``collate(decode(read(rows)))``: the batch of ``rows`` without actors (evaluation)."""
        return self.collate(self.decode(self.read(rows)))


class Synthetic:
    """``PlantedCriteo``'s rows with the ``read``/``decode`` of the file readers: ``read`` gathers the rows
    from the columns ``synthetic.ensure`` wrote once (memory-mapped), ``decode`` hands them on as columns
    (the encoder takes columns: no Python tuple per row)."""

    def __init__(self, columns: PlantedColumns):
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns)

    def read(self, rows) -> tuple:
        return self.columns.read(rows)

    def decode(self, raw: tuple) -> Columns:
        return Columns(*raw)


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
        source = Synthetic(PlantedColumns(ensure(planted, str(data.cache_dir))))

        def bayes(rows):
            return planted.generate(torch.as_tensor(rows) + n_train)["prob"]

        return Splits(Rows(source, encoder, 0, n_train), Rows(source, encoder, n_train, n_train + n_val),
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
