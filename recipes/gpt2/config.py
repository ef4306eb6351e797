"""GPT-2's ``cfg.model`` and ``cfg.data``: the typed schemas and the checks only a language model needs.

``configs/model/gpt2*.yaml`` and ``configs/data/{stdlib,text}.yaml`` fill
them. Interpolations: ``data.seq_len`` defaults to ``${model.n_positions}``
and ``data.vocab_size`` to ``${model.vocab_size}``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Optional

from omegaconf import II

from .data.source import names_local_path
from .data.tokenizer import MIN_VOCAB_SIZE
from .model import GPT2Config, padded_vocab_size

DATA_SOURCES = ("stdlib", "text")

#: Dimensions of the published GPT-2 checkpoints (for ``trainer.init_from``).
HF_GPT2_DIMS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, n_positions=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, n_positions=1024),
}


@dataclass
class ModelConfig:
    """GPT-2 dimensions; ``dropout`` sets GPT-2's three dropout probabilities at once.

    ``vocab_size`` is the tokenizer's (a published GPT-2's 50257);
    ``make_vocab_size_divisible_by`` pads the embedding and LM head to a
    multiple of it (Megatron's option), with the padded ids' logits at
    ``-inf``, so that a tensor-parallel degree dividing the padded size
    works. Unlike Megatron the multiple is not also multiplied by ``tp``:
    the parameters' shapes do not depend on the layout, so checkpoints
    reshard between any layouts.

    ``name`` labels the preset (run names, W&B); the dimensions are what count.
    """

    name: str = "gpt2-tiny"
    vocab_size: int = 8192
    n_positions: int = 256
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    make_vocab_size_divisible_by: int = 1


@dataclass
class DataConfig:
    """The token stream (mapped onto ``recipes.gpt2.data.prepare``).

    - ``source``: ``stdlib`` (this Python's standard-library source, always
      available) or ``text`` (the local ``path``: a file or directory of
      ``.txt``/``.jsonl``/``.parquet``; ``text_field`` names the column of the
      latter two).
    - ``vocab_size``: ids of the BPE tokenizer trained on the corpus (at most
      ``model.vocab_size``, which may be padded above it); ``tokenizer``: a
      ``tokenizer.json`` to use instead of training one.
    - ``seq_len``: tokens per sample (at most ``model.n_positions``).
    - ``val_fraction``: share of documents held out for evaluation (0 only
      with ``trainer.eval_every=0``).
    - ``cache_dir``: where tokenizers and token files are cached.
    - ``max_bytes``: corpus bytes read at most (``None`` = all).
    """

    source: str = "stdlib"
    path: Optional[str] = None
    text_field: str = "text"
    tokenizer: Optional[str] = None
    vocab_size: int = II("model.vocab_size")
    seq_len: int = II("model.n_positions")
    val_fraction: float = 0.05
    cache_dir: str = "${oc.env:SBP_CACHE_DIR,'~/.cache/sbp-recipes'}"
    max_bytes: Optional[int] = 4_000_000


def gpt2_config_kwargs(model: Any) -> dict:
    """Keyword arguments of ``recipes.gpt2.model.GPT2Config`` for a ``model`` config node.

    ``dropout`` becomes ``embd_pdrop``, ``resid_pdrop`` and ``attn_pdrop``.
    Use: ``GPT2Config(**gpt2_config_kwargs(cfg.model))``.
    """
    # ``.get``: a run's saved config from before a field existed has the field's default.
    return {f.name: type(f.default)(model.dropout if f.name.endswith("_pdrop") else model.get(f.name, f.default))
            for f in fields(GPT2Config)}


def problems(cfg, layout, trains_tokenizer: bool = True) -> list:
    """GPT-2's rules: dimensions, whole heads and vocabulary per tp rank, sequence and vocabulary of the data."""
    p: list = []
    m, tr = cfg.model, cfg.trainer
    dims_ok = True
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "make_vocab_size_divisible_by"):
        if m[key] < 1:
            p.append(f"model.{key}={m[key]!r}: must be >= 1")
            dims_ok = False
    if not dims_ok:
        return p
    if m.n_embd % m.n_head:
        p.append(f"model.n_embd={m.n_embd}: must divide by model.n_head={m.n_head} (head dim)")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout={m.dropout}: must be in [0, 1)")
    if m.n_head % layout.tp:
        p.append(f"model.n_head={m.n_head}: must divide by parallel.tp={layout.tp} (whole heads per "
                 f"rank); valid tp: {[d for d in range(1, m.n_head + 1) if m.n_head % d == 0]}")
    rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if rows % layout.tp:
        multiple = 128 * layout.tp if 128 % layout.tp else 128
        p.append(f"model.vocab_size={m.vocab_size} (embedding rows: {rows}) must divide by parallel.tp="
                 f"{layout.tp} (vocab-parallel embedding and loss); valid: pad the rows, e.g. "
                 f"model.make_vocab_size_divisible_by={multiple} ({padded_vocab_size(m.vocab_size, multiple)} rows)")
    p += data_problems(cfg, layout, "n_positions", trains_tokenizer)
    if tr.init_from in HF_GPT2_DIMS:
        want = HF_GPT2_DIMS[tr.init_from]
        wrong = {k: m[k] for k, v in want.items() if m[k] != v}
        if wrong:
            p.append(f"trainer.init_from={tr.init_from!r}: the checkpoint has "
                     f"{ {k: want[k] for k in wrong} } but the model has {wrong}; valid: "
                     f"model={tr.init_from}")
        if m.vocab_size != 50257:
            p.append(f"trainer.init_from={tr.init_from!r}: the checkpoint has 50257 tokens, "
                     f"model.vocab_size={m.vocab_size}; valid: 50257 (with tensor parallelism pad the rows with "
                     "model.make_vocab_size_divisible_by, e.g. 128)")
    return p


def data_problems(cfg, layout, positions_key: str, trains_tokenizer: bool = True) -> list:
    """The token data's rules for a language model whose context holds ``cfg.model[positions_key]`` tokens:
    the corpus, the tokenizer, the sequence length (and its split under sequence parallelism), the vocabulary
    against the model's ``vocab_size``, the held-out share."""
    p: list = []
    m, data, par, tr = cfg.model, cfg.data, cfg.parallel, cfg.trainer
    positions = m[positions_key]
    if data.source not in DATA_SOURCES:
        p.append(f"data.source={data.source!r}: unknown choice; valid: {', '.join(DATA_SOURCES)}")
    elif data.source == "text" and data.path is None:
        p.append("data.path=None: data.source=text needs a path; valid: a .txt/.jsonl/.parquet file "
                 "or a directory of them")
    elif data.source == "text" and names_local_path(str(data.path)) \
            and not os.path.exists(os.path.expanduser(str(data.path))):  # (a hub dataset name is checked when read)
        p.append(f"data.path={data.path!r}: no such file or directory; valid: a .txt/.jsonl/.parquet file "
                 "or a directory of them")
    if data.tokenizer is not None and not os.path.isfile(os.path.expanduser(str(data.tokenizer))):
        p.append(f"data.tokenizer={data.tokenizer!r}: no such file; valid: a tokenizer.json, or null to train "
                 "one on the corpus")
    seq_len = data.seq_len
    if seq_len < 2:
        p.append(f"data.seq_len={seq_len!r}: must be >= 2 (next-token targets)")
    elif seq_len > positions:
        p.append(f"data.seq_len={seq_len}: exceeds model.{positions_key}={positions}; "
                 f"valid: 2..{positions}")
    if par.sequence_parallel and layout.tp > 1 and seq_len % layout.tp:
        p.append(f"data.seq_len={seq_len}: sequence_parallel splits it over parallel.tp={layout.tp}; "
                 "valid: a multiple of tp, or parallel.sequence_parallel=false")
    parts = layout.cp * (layout.tp if par.sequence_parallel else 1)
    if layout.cp > 1 and seq_len % parts:
        over = f"parallel.cp={layout.cp}" + (f" times parallel.tp={layout.tp} (sequence_parallel)"
                                             if parts != layout.cp else "")
        p.append(f"data.seq_len={seq_len}: context parallelism splits it over {over}; valid: a multiple of {parts}")
    low = MIN_VOCAB_SIZE if trains_tokenizer else 2  # a trained byte-level BPE holds every byte
    if not low <= data.vocab_size <= m.vocab_size:
        why = "token ids must index the embedding" if data.vocab_size > m.vocab_size else \
            "the tokenizer trained on the corpus has the 256 bytes and the end-of-text token" if trains_tokenizer \
            else "a tokenizer has at least 2 ids"
        p.append(f"data.vocab_size={data.vocab_size}: {why}; valid: {low}..model.vocab_size={m.vocab_size}")
    if not 0.0 <= data.val_fraction < 1.0:
        p.append(f"data.val_fraction={data.val_fraction}: must be in [0, 1)")
    elif data.val_fraction == 0 and tr.eval_every > 0:
        p.append(f"data.val_fraction=0.0: holds out nothing, but trainer.eval_every={tr.eval_every} "
                 "evaluates; valid: data.val_fraction > 0, or trainer.eval_every=0")
    if data.max_bytes is not None and data.max_bytes < 1:
        p.append(f"data.max_bytes={data.max_bytes!r}: must be >= 1 (or null for the whole corpus)")
    return p
