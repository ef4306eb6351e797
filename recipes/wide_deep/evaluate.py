"""Exact AUC and log loss of the held-out split, on every rank of the job (known on rank 0).

Each chunk of ``batch`` held-out rows is laid out like the training batch
(``data_sbp``; each rank reads only its own rows of the chunk), scored by
the model in eval mode (no dropout), and its logits and labels are gathered
(``full_tensor``: ``4 * batch`` bytes each per chunk), so rank 0 ends with
every held-out row's score and computes the AUC over all pairs. With the
planted synthetic data the same rows' true probabilities give the Bayes
AUC and log loss, the ceiling the model is measured against.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core.layout import local_box
from sbp_core.process_groups import world_rank

from .features import FIELDS
from .metrics import auc, logloss
from .synthetic import bayes_logloss_floor


def _global(local: torch.Tensor, placement, sbp, rows: int) -> sc.GlobalTensor:
    shape = torch.Size((rows,) + tuple(local.shape[1:]))
    return sc.GlobalTensor(local, sc.Layout(placement, tuple(sbp), shape, local.dtype))


@torch.no_grad()
def evaluate(module, val, placement, data_sbp, n_rows: int, batch: int, bayes=None) -> dict | None:
    """``{"auc", "logloss"[, "bayes_auc", "bayes_logloss"]}`` of the first ``n_rows`` held-out rows on rank 0."""
    me = world_rank()
    coords = placement.coords(me)
    was = module.training
    module.eval()
    logits, labels = [], []
    try:
        for start in range(0, n_rows, batch):
            size = min(batch, n_rows - start)
            (lo, n), = local_box((size,), placement.shape, data_sbp, coords)
            got = val.load(torch.arange(start + lo, start + lo + n))  # host rows
            x = {k: _global(got[k].to(placement.device()), placement, data_sbp, size) for k in FIELDS}
            logits.append(module(x["dense"], x["ids"]).full_tensor())
            labels.append(x["label"].full_tensor())
    finally:
        module.train(was)
    if me != 0:
        return None
    scores, truth = torch.cat(logits).cpu(), torch.cat(labels).cpu()  # beside the host's Bayes probabilities
    out = {"auc": auc(scores, truth), "logloss": logloss(scores, truth)}
    if bayes is not None:
        prob = bayes(torch.arange(n_rows))
        out.update(bayes_auc=auc(prob, truth), bayes_logloss=bayes_logloss_floor(prob, truth))
    return out
