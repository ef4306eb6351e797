"""Wide&Deep's config nodes: ``cfg.model`` and ``cfg.data`` as typed schemas, and what they build.

``ModelSchema`` (``configs/model/wide-deep*.yaml``):

- ``vocab_size``: rows of one vocabulary shared by the 26 fields (10^5 ...
  10^8 and beyond: the tables are built shard by shard), or
  ``field_vocab_sizes``: one size per field (the table is their sum), which
  then wins;
- ``embed_dim`` (deep table columns), ``hidden`` (MLP widths), ``dropout``,
  ``init_scale`` (tables ``U(-s, s)``), ``sparse_grad`` (row gradients),
  ``dense_table_state`` (lazy Adam moments for every row instead of only
  the rows looked up), ``hash_seed``.

``DataSchema`` (``configs/data/*.yaml``): ``source`` is ``synthetic`` (the
planted model, the default: runs offline), ``criteo_tsv`` (Kaggle /
Terabyte TSV files) or ``criteo_parquet``; ``path``: a file, a directory
(its files in name order) or a glob; ``val_fraction``: the held-out tail;
``eval_rows``: held-out rows scored each evaluation (``None``: all), in
chunks of ``eval_batch``;
``max_wrong_columns``: TSV lines with a wrong column count tolerated per
file; ``cache_dir``: the TSV files' line indexes and the synthetic rows
(encoded and written once, about 260 bytes a row); synthetic: ``train_rows``,
``val_rows``, ``seed``, ``max_cardinality``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .features import N_DENSE, N_FIELDS
from .hashing import FeatureHasher
from .model import WideDeepConfig

SOURCES = ("synthetic", "criteo_tsv", "criteo_parquet")


@dataclass
class ModelSchema:
    name: str = "wide-deep"
    vocab_size: int = 100_000
    field_vocab_sizes: Optional[List[int]] = None
    embed_dim: int = 16
    hidden: List[int] = field(default_factory=lambda: [1024] * 7)
    dropout: float = 0.5
    init_scale: float = 0.05
    sparse_grad: bool = True
    dense_table_state: bool = False
    hash_seed: int = 0


@dataclass
class DataSchema:
    source: str = "synthetic"
    path: Optional[str] = None
    val_fraction: float = 0.05
    eval_rows: Optional[int] = None
    eval_batch: int = 4096
    max_wrong_columns: int = 100
    cache_dir: str = "${oc.env:SBP_CACHE_DIR,'~/.cache/sbp-recipes'}"
    train_rows: int = 1_000_000
    val_rows: int = 20_000
    seed: int = 0
    max_cardinality: int = 200


def hasher(model) -> FeatureHasher:
    sizes = model.field_vocab_sizes
    if sizes is not None:
        return FeatureHasher(N_FIELDS, field_vocab_sizes=list(sizes), seed=int(model.hash_seed))
    return FeatureHasher(N_FIELDS, vocab_size=int(model.vocab_size), seed=int(model.hash_seed))


def table_rows(model) -> int:
    sizes = model.field_vocab_sizes
    return int(sum(sizes)) if sizes is not None else int(model.vocab_size)


def model_config(model, meta_tables: bool = True) -> WideDeepConfig:
    return WideDeepConfig(n_dense=N_DENSE, n_fields=N_FIELDS, table_rows=table_rows(model),
                          embed_dim=int(model.embed_dim), hidden=[int(h) for h in model.hidden],
                          dropout=float(model.dropout), init_scale=float(model.init_scale),
                          sparse_grad=bool(model.sparse_grad), meta_tables=meta_tables)


def problems(model, data) -> list:
    """What is wrong with ``cfg.model`` / ``cfg.data`` on their own (ranges and choices)."""
    out = []
    sizes = model.field_vocab_sizes
    if sizes is not None and (len(sizes) != N_FIELDS or any(int(v) < 1 for v in sizes)):
        out.append(f"model.field_vocab_sizes={list(sizes)}: give {N_FIELDS} sizes >= 1 (one per field)")
    if sizes is None and int(model.vocab_size) < 1:
        out.append(f"model.vocab_size={model.vocab_size}: must be >= 1")
    if int(model.embed_dim) < 1 or not model.hidden or any(int(h) < 1 for h in model.hidden):
        out.append(f"model.embed_dim={model.embed_dim}, model.hidden={list(model.hidden)}: need sizes >= 1")
    if not 0 <= float(model.dropout) < 1:
        out.append(f"model.dropout={model.dropout}: must be in [0, 1)")
    if data.source not in SOURCES:
        out.append(f"data.source={data.source!r} is not one of {SOURCES}")
    elif data.source != "synthetic" and not data.path:
        out.append(f"data.source={data.source} needs data.path (a file, a directory or a glob)")
    elif data.source != "synthetic":
        from .data import files_of

        try:
            files_of(str(data.path))
        except FileNotFoundError as err:
            out.append(str(err))
    if not 0 < float(data.val_fraction) < 1:
        out.append(f"data.val_fraction={data.val_fraction}: must be in (0, 1)")
    if int(data.eval_batch) < 1:
        out.append(f"data.eval_batch={data.eval_batch}: must be >= 1")
    if data.eval_rows is not None and int(data.eval_rows) < 2:
        out.append(f"data.eval_rows={data.eval_rows}: AUC needs at least 2 rows (or null for all)")
    if data.source == "synthetic" and (int(data.train_rows) < 1 or int(data.val_rows) < 2):
        out.append(f"data.train_rows={data.train_rows}, data.val_rows={data.val_rows}: need >= 1 and >= 2")
    return out
