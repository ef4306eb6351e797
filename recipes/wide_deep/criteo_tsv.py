"""Criteo Kaggle / Terabyte TSV files as an indexable data set, malformed rows skipped and counted.

Both releases have one sample per line, 40 tab-separated columns: the
label (0/1), 13 integer counts (empty = missing) and 26 categorical values
(8 hex digits in Kaggle's ``train.txt`` and Terabyte's ``day_N``; empty =
missing). ``CriteoTSV(paths, ...)`` reads the well-formed lines of the
files in order, any line by index:

- once per file (cached under ``cache_dir``, keyed by path, size and
  mtime, built once even when every rank asks: ``build_once``) a scan
  records each well-formed line's byte offset; a line is *malformed* when
  it has another number of columns, a label other than 0/1 or a count that
  is not an integer; malformed lines are skipped and counted, and
  ``summary()`` names how many and the first line numbers;
- more than ``max_wrong_columns`` lines with a wrong column count (in any
  one file) is an error naming the file, the line and its column count,
  raised before any sample is read (a wrong delimiter or file type, not a
  few torn lines);
- ``read(rows)`` seeks to the lines, ``decode`` parses them into samples
  (``features``), hex values straight to their 64-bit keys.

"""
from __future__ import annotations

import json
import os
import threading
from array import array

import numpy as np

from toolkit.data.build_once import build_once, content_key

from .features import N_DENSE, N_FIELDS
from .hashing import value_key

N_COLUMNS = 1 + N_DENSE + N_FIELDS
FIRST_LINES = 10  # line numbers kept per kind of problem for the summary
INDEX_VERSION = 1


def _is_int(b: bytes) -> bool:
    return b.lstrip(b"-").isdigit()


def line_problem(parts: list) -> str | None:
    """Why a split line is not a sample, or ``None``."""
    if len(parts) != N_COLUMNS:
        return "columns"
    if parts[0] not in (b"0", b"1"):
        return "label"
    if not all(not x or _is_int(x) for x in parts[1:1 + N_DENSE]):
        return "count"
    return None


def _scan(path: str, out_dir: str) -> None:
    """Write ``offsets.npy`` (well-formed lines) and ``summary.json`` for one file."""
    offsets = array("q")
    problems = {"columns": [], "label": [], "count": []}
    counts = dict.fromkeys(problems, 0)
    columns_seen = []
    pos = 0
    n = 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip(b"\r\n").split(b"\t")
            why = line_problem(parts)
            if why is None:
                offsets.append(pos)
            else:
                counts[why] += 1
                if why == "columns":
                    if len(problems["columns"]) < 1000:
                        problems["columns"].append(n)
                        columns_seen.append(len(parts))
                elif len(problems[why]) < FIRST_LINES:
                    problems[why].append(n)
            pos += len(line)
    np.save(os.path.join(out_dir, "offsets.npy"), np.frombuffer(offsets, dtype=np.int64))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"lines": n, "counts": counts, "lines_of": problems, "columns_seen": columns_seen}, f)


class CriteoTSV:
    """The well-formed lines of Criteo TSV ``paths`` (see the module docstring)."""

    def __init__(self, paths, cache_dir: str, max_wrong_columns: int = 100):
        self.paths = [os.path.abspath(os.path.expanduser(p)) for p in ([paths] if isinstance(paths, str) else paths)]
        if not self.paths:
            raise ValueError("data.path lists no Criteo TSV file")
        offsets, self.summaries = [], []
        for path in self.paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Criteo TSV file {path} does not exist")
            if path.endswith((".gz", ".bz2", ".xz", ".zst")):
                raise ValueError(f"{path} is compressed: decompress it first (random access needs the plain TSV)")
            st = os.stat(path)
            key = content_key({"path": path, "size": st.st_size, "mtime": st.st_mtime_ns, "v": INDEX_VERSION})
            where = os.path.join(os.path.expanduser(cache_dir), "criteo-index", key)
            build_once(where, lambda tmp, path=path: _scan(path, tmp))
            with open(os.path.join(where, "summary.json")) as f:
                summary = json.load(f)
            self._check_columns(path, summary, max_wrong_columns)
            self.summaries.append(summary)
            offsets.append(np.load(os.path.join(where, "offsets.npy"), mmap_mode="r"))
        self._offsets = offsets
        self._ends = np.cumsum([len(o) for o in offsets])
        self._n = int(self._ends[-1])
        if self._n == 0:
            raise ValueError(f"no well-formed Criteo line in {self.paths}: {self.summary()}")
        self._files: dict = {}

    @staticmethod
    def _check_columns(path: str, summary: dict, limit: int) -> None:
        wrong = summary["counts"]["columns"]
        if wrong > limit:
            lines, seen = summary["lines_of"]["columns"], summary["columns_seen"]
            k = min(limit, len(lines) - 1)
            raise ValueError(
                f"{path}:{lines[k]}: {seen[k]} columns, a Criteo line has {N_COLUMNS} tab-separated columns "
                f"(label, {N_DENSE} counts, {N_FIELDS} categorical); {wrong} of {summary['lines']} lines have "
                f"another count (first at lines {lines[:FIRST_LINES]}), more than data.max_wrong_columns={limit}: "
                "is this a Criteo TSV file?")

    def summary(self) -> str:
        """How many malformed lines were skipped per file and where the first ones are."""
        parts = []
        for path, s in zip(self.paths, self.summaries):
            bad = sum(s["counts"].values())
            if not bad:
                continue
            where = ", ".join(f"{kind} at lines {s['lines_of'][kind][:FIRST_LINES]}"
                              for kind, c in s["counts"].items() if c)
            parts.append(f"{path}: skipped {bad} malformed of {s['lines']} lines ({where})")
        return "; ".join(parts) or f"no malformed lines in {len(self.paths)} file(s)"

    @property
    def n_malformed(self) -> int:
        return sum(sum(s["counts"].values()) for s in self.summaries)

    def __len__(self) -> int:
        return self._n

    def _locate(self, rows: np.ndarray) -> tuple:
        g = rows
        file_ids = np.searchsorted(self._ends, g, side="right")
        first = np.concatenate([[0], self._ends[:-1]])
        return file_ids, g - first[file_ids]

    def read(self, rows) -> list:
        """The raw lines of ``rows`` (indices of well-formed lines), in that order."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the {len(self)} well-formed lines")
        file_ids, local = self._locate(rows)
        out = [b""] * rows.size
        here = (os.getpid(), threading.get_ident())  # a handle per process and thread: seek and read are not shared
        for i in np.lexsort((local, file_ids)):  # in file order: sequential-ish reads
            f = self._files.get((here, file_ids[i]))
            if f is None:
                f = self._files[(here, file_ids[i])] = open(self.paths[file_ids[i]], "rb")
            f.seek(int(self._offsets[file_ids[i]][local[i]]))
            out[i] = f.readline()
        return out

    def decode(self, lines: list) -> list:
        """Samples ``(label, counts, keys)`` of well-formed lines."""
        return [parse_line(line) for line in lines]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_files"] = {}
        return state


def parse_line(line: bytes) -> tuple:
    parts = line.rstrip(b"\r\n").split(b"\t")
    return (int(parts[0]), [int(x) if x else 0 for x in parts[1:1 + N_DENSE]],
            [value_key(x) for x in parts[1 + N_DENSE:N_COLUMNS]])
