"""``open_corpus(source)``: the corpus a config's ``data.source`` names (``corpus`` for the local and standard-library
sources, ``hub`` for hub datasets)."""
from __future__ import annotations

import os

from .corpus import LOCAL_SUFFIXES, Corpus, local_corpus, stdlib_corpus, suffix_of
from .hub import hub_corpus


def names_local_path(source: str) -> bool:
    """Is corpus ``source`` a local path (an existing one, or one that starts with ``/``, ``./``, ``../``
    or ``~`` or ends in a local suffix) rather than a hub dataset name?"""
    return os.path.exists(os.path.expanduser(source)) or source.startswith(("/", "./", "../", "~")) \
        or os.path.isabs(source) or suffix_of(source) in LOCAL_SUFFIXES


def open_corpus(source=None, max_bytes: int | None = None, text_field: str = "text",
                config: str | None = None, split: str = "train") -> Corpus:
    """The corpus ``source`` names (see the module docstring); a ``Corpus`` is returned as is.

    A string that is an existing path, starts with ``/``, ``./``, ``../`` or
    ``~``, or ends in a local suffix is a local path (missing:
    ``FileNotFoundError``); any other string is a hub dataset name
    (``config``/``split`` apply to it only).
    """
    if isinstance(source, Corpus):
        if max_bytes is not None and max_bytes != source.max_bytes:
            raise ValueError(f"max_bytes={max_bytes!r} given with a Corpus capped at {source.max_bytes!r}; "
                             "cap the corpus when opening it")
        return source
    if source is None or source == "stdlib":
        return stdlib_corpus(max_bytes)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise TypeError(f"corpus source must be None, 'stdlib', a path, a hub dataset name or a Corpus, "
                        f"got {source!r}")
    if names_local_path(source):
        return local_corpus(source, max_bytes, text_field)
    return hub_corpus(source, config, split, text_field, max_bytes)
