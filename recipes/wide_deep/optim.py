"""Wide&Deep's optimizer: ``LazyAdamW`` with the MLP dense and the tables lazy.

Three groups (every layout builds them alike, as checkpoints require):
MLP weights with ``trainer.weight_decay``, MLP biases without, and the
tables (``wide.weight``, ``deep.weight``) without decay and with
``dense_table_state`` (``model.dense_table_state``). Tables with sparse gradients take lazy Adam
(only looked-up rows move); with ``model.sparse_grad=false`` they take
AdamW's dense step like the MLP.
"""
from __future__ import annotations

from toolkit.lazy_adam import LazyAdamW

from .plan import TABLES


def build_optimizer(module, trainer, dense_table_state: bool = False) -> LazyAdamW:
    betas = tuple(float(b) for b in trainer.betas)
    if len(betas) != 2:
        raise ValueError(f"trainer.betas={list(betas)}: must be two numbers, e.g. [0.9, 0.999]")
    groups = {"decay": [], "no_decay": [], "tables": []}
    names = {k: [] for k in groups}
    for name, p in module.named_parameters():
        key = "tables" if name in TABLES else "decay" if p.dim() >= 2 else "no_decay"
        groups[key].append(p)
        names[key].append(name)
    wd = float(trainer.weight_decay)
    return LazyAdamW([
        {"params": groups["decay"], "names": names["decay"], "weight_decay": wd},
        {"params": groups["no_decay"], "names": names["no_decay"], "weight_decay": 0.0},
        {"params": groups["tables"], "names": names["tables"], "weight_decay": 0.0,
         "dense_state": bool(dense_table_state)},
    ], lr=float(trainer.lr), betas=betas, eps=float(trainer.eps))
