"""Hugging Face hub datasets as corpora: the one source that needs the network.

``hub_corpus(name)`` reads a hub dataset with ``datasets.load_dataset``. It
is refused up front, with ``OfflineError`` saying to pass a local path, when
the environment declares the machine offline (``HF_DATASETS_OFFLINE`` or
``HF_HUB_OFFLINE`` set to 1/true/yes/on, read at call time); a download that
fails for lack of a connection raises the same error.
"""
from __future__ import annotations

import os

from toolkit.data.build_once import content_key
from .corpus import Corpus, check_max_bytes

OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class OfflineError(RuntimeError):
    """A hub dataset was asked for while the machine is offline (declared, or no connection)."""


def is_offline() -> bool:
    """True when ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to 1/true/yes/on."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "TRUE", "YES", "ON") for k in OFFLINE_ENV)


def _is_network_error(e: BaseException) -> bool:
    """A connection failure, whichever HTTP stack ``datasets`` runs on (requests or httpx)."""
    return isinstance(e, ConnectionError) or type(e).__module__.split(".")[0] in ("requests", "httpx", "urllib3")


_LOCAL_HINT = ("pass a local path instead: a .txt file or directory of them, a .jsonl file "
               "(one JSON object per line with a text field), a .parquet file, or 'stdlib'")


def hub_corpus(name: str, config: str | None = None, split: str = "train", text_field: str = "text",
               max_bytes: int | None = None, streaming: bool | None = None) -> Corpus:
    """A Hugging Face hub dataset, via ``datasets.load_dataset(name, config, split=split)``.

    ``streaming`` defaults to True when ``max_bytes`` is set (read only what
    the cap needs) and False otherwise (download once into the ``datasets``
    cache; the two passes, tokenizer training and tokenizing, then read it
    locally). Refused with ``OfflineError`` when ``is_offline()``; a failed
    download is re-raised as ``OfflineError`` and an unknown name as
    ``FileNotFoundError``, both advising a local path. The
    identity covers name, config, split, field and cap, not the dataset's
    revision.
    """
    max_bytes = check_max_bytes(max_bytes)
    if is_offline():
        flags = {k: os.environ[k] for k in OFFLINE_ENV if k in os.environ}
        raise OfflineError(f"corpus {name!r} is not a local path, so it would be a Hugging Face hub dataset, "
                           f"but the machine is offline ({flags}); {_LOCAL_HINT}")
    import datasets

    if streaming is None:
        streaming = max_bytes is not None
    what = f"hub dataset {name!r} (config {config!r}, split {split!r})"
    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{name!r} is no local path and {what} was not found "
                                f"({type(e).__name__}: {e}); {_LOCAL_HINT}") from e
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise OfflineError(f"could not download {what}: {type(e).__name__}: {e}; {_LOCAL_HINT}") from e
    columns = rows.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"hub dataset {name!r}: no column {text_field!r}; the columns are {sorted(columns)}")

    def stream():
        for row in rows:
            text = row[text_field]
            if text is not None:
                yield text

    identity = content_key({"kind": "hub", "name": name, "config": config, "split": split,
                            "text_field": text_field, "max_bytes": max_bytes})
    return Corpus(f"hub:{name}" + (f"/{config}" if config else "") + f":{split}", identity, max_bytes, stream)
