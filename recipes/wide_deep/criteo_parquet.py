"""Criteo columns in parquet files as an indexable data set (``pyarrow``), read a row group at a time.

``CriteoParquet(paths, label="label", dense=["I1".."I13"], cats=["C1".."C26"])``
(the column names of Criteo's Kaggle release as most parquet exports use
them). A file without one of these columns is an error naming the file and
the missing columns. A row whose label is missing or not 0/1 is malformed:
skipped and counted (``summary()``: how many, first row numbers); missing
counts read 0; categorical columns may be strings (hex or not) or integers
of any size (hashed either way, ``hashing.value_key``). Only the label
column is read up front; ``read(rows)`` reads the row groups holding the
rows (the last one per file stays cached), ``decode`` returns samples as
``features`` defines them.
"""
from __future__ import annotations

import os

import numpy as np

from .features import N_DENSE, N_FIELDS
from .hashing import keys_of, value_key

FIRST_ROWS = 10


def default_columns() -> tuple:
    return "label", [f"I{i}" for i in range(1, N_DENSE + 1)], [f"C{i}" for i in range(1, N_FIELDS + 1)]


class CriteoParquet:
    """The well-formed rows of parquet ``paths`` (see the module docstring)."""

    def __init__(self, paths, label: str | None = None, dense=None, cats=None):
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        d_label, d_dense, d_cats = default_columns()
        self.label, self.dense, self.cats = label or d_label, list(dense or d_dense), list(cats or d_cats)
        if len(self.dense) != N_DENSE or len(self.cats) != N_FIELDS:
            raise ValueError(f"{len(self.dense)} dense and {len(self.cats)} categorical columns given; "
                             f"the model reads {N_DENSE} and {N_FIELDS}")
        self.paths = [os.path.abspath(os.path.expanduser(p)) for p in ([paths] if isinstance(paths, str) else paths)]
        self._valid, self._groups, self.malformed = [], [], []
        for path in self.paths:
            pf = pq.ParquetFile(path)
            names = set(pf.schema_arrow.names)
            missing = [c for c in [self.label] + self.dense + self.cats if c not in names]
            if missing:
                raise ValueError(f"{path}: no column(s) {missing}; it has {sorted(names)[:45]}")
            lab = pf.read(columns=[self.label]).column(0)
            ok = pc.fill_null(pc.is_in(pc.cast(lab, "float64"), value_set=pa.array([0.0, 1.0])),
                              False).to_numpy(zero_copy_only=False)
            self._valid.append(np.flatnonzero(ok).astype(np.int64))
            bad = np.flatnonzero(~ok)
            self.malformed.append((int(bad.size), (bad[:FIRST_ROWS] + 1).tolist(), len(ok)))
            self._groups.append(np.cumsum([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]))
        self._ends = np.cumsum([len(v) for v in self._valid])
        self._n = int(self._ends[-1])
        if self._n == 0:
            raise ValueError(f"no row with a 0/1 label in {self.paths}: {self.summary()}")
        self._cache: dict = {}

    def summary(self) -> str:
        parts = [f"{p}: skipped {n} of {total} rows without a 0/1 label (rows {first})"
                 for p, (n, first, total) in zip(self.paths, self.malformed) if n]
        return "; ".join(parts) or f"no malformed rows in {len(self.paths)} file(s)"

    @property
    def n_malformed(self) -> int:
        return sum(m[0] for m in self.malformed)

    def __len__(self) -> int:
        return self._n

    def _group(self, f: int, g: int):
        key = (f, g)
        table = self._cache.get(key)
        if table is None:
            import pyarrow.parquet as pq

            table = pq.ParquetFile(self.paths[f]).read_row_group(g, columns=[self.label] + self.dense + self.cats)
            cache = {k: v for k, v in self._cache.items() if k[0] != f}  # one cached group per file
            cache[key] = table
            self._cache = cache  # a dict is changed only before it is published: threads may read at once
        return table

    def read(self, rows) -> list:
        """``(label, counts, categorical values)`` arrays of ``rows`` (indices of well-formed rows), in that order."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the {len(self)} well-formed rows")
        g = rows
        files = np.searchsorted(self._ends, g, side="right")
        first = np.concatenate([[0], self._ends[:-1]])
        labels = np.zeros(rows.size, np.float32)
        dense = np.zeros((rows.size, N_DENSE), np.float64)
        keys = np.zeros((rows.size, N_FIELDS), np.uint64)
        for f in np.unique(files):
            sel = np.flatnonzero(files == f)
            file_rows = self._valid[f][g[sel] - first[f]]
            groups = np.searchsorted(self._groups[f], file_rows, side="right")
            starts = np.concatenate([[0], self._groups[f][:-1]])
            for grp in np.unique(groups):
                here = sel[groups == grp]
                table = self._group(int(f), int(grp)).take(file_rows[groups == grp] - starts[grp])
                labels[here] = table.column(self.label).to_numpy(zero_copy_only=False)
                for j, c in enumerate(self.dense):
                    dense[here, j] = table.column(c).fill_null(0).to_numpy(zero_copy_only=False)
                keys[here] = np.stack([_column_keys(table.column(c)) for c in self.cats], 1)
        return [labels, dense, keys]

    def decode(self, raw) -> list:
        labels, dense, keys = raw
        return list(zip(labels.tolist(), dense.tolist(), keys.tolist()))


def _column_keys(column) -> np.ndarray:
    """uint64 keys of one categorical column (integers without nulls fast; anything else value by value)."""
    import pyarrow.types as pt

    if pt.is_integer(column.type) and column.null_count == 0:
        return keys_of(column.to_numpy()[:, None])[:, 0]
    return np.array([value_key(v) for v in column.to_pylist()], dtype=np.uint64)
