"""Text corpora: where the documents a tokenizer and a token file are built from come from.

A ``Corpus`` is a re-iterable, deterministic stream of text documents (one
``str`` each, never empty) plus an ``identity``: a digest that changes when
the documents may have changed, used as a cache key. Documents are streamed,
never all held in memory.

Sources (``open_corpus(source)``):

- ``None`` or ``"stdlib"``: the embedded default, present on every machine
  with Python: the ``*.py`` files of the installed standard library
  (``sysconfig.get_paths()["stdlib"]``) without ``site-packages``, the test
  suites (directories named ``test``, ``tests``, ``idle_test``) and
  ``__pycache__``, and without any file that is not valid UTF-8; one file is
  one document, in sorted order of the path relative to the library root.
- a ``.txt`` file: documents separated by one or more blank lines;
- a ``.jsonl`` file: one JSON object per line, the document is its
  ``text_field``;
- a ``.parquet`` file: one row per document, the ``text_field`` column
  (read with ``datasets``, streamed, no network);
- a directory: every ``.txt``, ``.jsonl`` or ``.parquet`` file below it (one
  kind only), in sorted relative-path order;
- anything else is a Hugging Face hub dataset name (``hub.hub_corpus``);
  this is the only source that uses the network, and it is refused when
  ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set.

``max_bytes`` caps the total UTF-8 size of the documents: the stream stops
there, cutting the last document at a character boundary (for fast tests and
quick runs).
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from toolkit.data.build_once import content_key

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """A deterministic stream of documents with a cache identity.

    ``documents()`` yields the same non-empty strings in the same order on
    every call (at most ``max_bytes`` UTF-8 bytes in all when it is set).
    ``identity`` is a hex digest of the source's description, its files'
    paths, sizes and modification times (or the hub name, config and split)
    and ``max_bytes``; ``description`` is for humans and metadata.
    """

    description: str
    identity: str
    max_bytes: int | None
    _stream: Callable[[], Iterable[str]] = field(repr=False, compare=False)

    def documents(self) -> Iterator[str]:
        """The documents, in order, capped at ``max_bytes`` UTF-8 bytes."""
        budget = self.max_bytes
        for doc in self._stream():
            if not doc:
                continue
            if budget is not None:
                data = doc.encode("utf-8")
                if len(data) >= budget:
                    cut = data[:budget].decode("utf-8", errors="ignore")
                    if cut:
                        yield cut
                    return
                budget -= len(data)
            yield doc


def check_max_bytes(max_bytes) -> int | None:
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be None (no cap) or a positive int, got {max_bytes!r}")
    return max_bytes


def _file_fingerprints(root: str, files: list) -> list:
    out = []
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        out.append([rel, st.st_size, st.st_mtime_ns])
    return out


def stdlib_files(root: str | None = None) -> list:
    """The standard library's ``*.py`` paths relative to ``root``, sorted ("/"-separated).

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Directories in
    ``STDLIB_SKIPPED_DIRS`` are not entered. Files are not opened here, so
    the list still holds files that ``stdlib_corpus`` will skip as non-UTF-8.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIPPED_DIRS]
        rel_dir = os.path.relpath(here, root)
        for name in files:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def stdlib_corpus(max_bytes: int | None = None) -> Corpus:
    """The installed Python standard library's source files, one document per file."""
    max_bytes = check_max_bytes(max_bytes)
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files under the standard library directory {root!r}")

    def stream():
        for rel in files:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few stdlib files are deliberately in other encodings

    version = "%d.%d.%d" % sys.version_info[:3]
    identity = content_key({"kind": "stdlib", "python": version, "root": root,
                            "files": _file_fingerprints(root, files), "max_bytes": max_bytes})
    return Corpus(f"stdlib:python-{version}", identity, max_bytes, stream)


def _txt_documents(path: str) -> Iterator[str]:
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines)
                lines = []
    if lines:
        yield "".join(lines)


def _jsonl_documents(path: str, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object: {e}") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{number}: no text field {text_field!r}; the record has {keys}")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: field {text_field!r} is a {type(text).__name__}, not a string")
            yield text


def _parquet_documents(path: str, text_field: str) -> Iterator[str]:
    import datasets

    rows = datasets.load_dataset("parquet", data_files=path, split="train", streaming=True)
    columns = rows.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"{path}: no column {text_field!r}; the columns are {sorted(columns)}")
    for row in rows:
        text = row[text_field]
        if text is not None:
            yield text


def _file_documents(path: str, suffix: str, text_field: str) -> Iterator[str]:
    if suffix == ".txt":
        return _txt_documents(path)
    if suffix == ".jsonl":
        return _jsonl_documents(path, text_field)
    return _parquet_documents(path, text_field)


def suffix_of(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def local_corpus(path: str, max_bytes: int | None = None, text_field: str = "text") -> Corpus:
    """A ``.txt``/``.jsonl``/``.parquet`` file, or a directory of files of one of those kinds."""
    max_bytes = check_max_bytes(max_bytes)
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(path):
        root = path
        files = []
        for here, _, names in os.walk(root):
            for name in names:
                if suffix_of(name) in LOCAL_SUFFIXES:
                    files.append(os.path.relpath(os.path.join(here, name), root).replace(os.sep, "/"))
        files.sort()
        kinds = sorted({suffix_of(f) for f in files})
        if not files:
            raise ValueError(f"directory {path!r} holds no {', '.join(LOCAL_SUFFIXES)} files")
        if len(kinds) > 1:
            raise ValueError(f"directory {path!r} mixes file kinds {kinds}; keep one of {list(LOCAL_SUFFIXES)}")
        suffix = kinds[0]
    elif os.path.isfile(path):
        suffix = suffix_of(path)
        if suffix not in LOCAL_SUFFIXES:
            raise ValueError(f"unsupported corpus file {path!r}: suffix {suffix!r}, valid suffixes {list(LOCAL_SUFFIXES)}")
        root, files = os.path.dirname(path), [os.path.basename(path)]
    else:
        raise FileNotFoundError(f"corpus path {path!r} does not exist")

    def stream():
        for rel in files:
            yield from _file_documents(os.path.join(root, rel), suffix, text_field)

    identity = content_key({"kind": "local", "root": root, "files": _file_fingerprints(root, files),
                            "text_field": text_field if suffix != ".txt" else None,
                            "max_bytes": max_bytes})
    return Corpus(f"local:{path}", identity, max_bytes, stream)
