"""Exact ROC AUC and log loss of click predictions.

``auc(scores, labels)`` is the Mann-Whitney statistic over *all* pairs:
the probability that a random positive scores above a random negative,
ties counting one half, from one sort (``O(n log n)``), not a binned or
sampled estimate. ``logloss(logits, labels)`` is the mean binary cross
entropy computed from logits (stable for saturated predictions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of ``scores`` (any monotone score: logits or probabilities) for 0/1 ``labels``."""
    scores = scores.detach().reshape(-1).double()
    labels = labels.detach().reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"{scores.numel()} scores for {labels.numel()} labels")
    pos = labels > 0.5
    n_pos = int(pos.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes; got {n_pos} positives and {n_neg} negatives")
    order = torch.argsort(scores)
    s = scores[order]
    # Average rank (1-based) of each run of equal scores.
    new_run = torch.ones_like(s, dtype=torch.bool)
    new_run[1:] = s[1:] != s[:-1]
    run_id = torch.cumsum(new_run, 0) - 1
    starts = torch.nonzero(new_run).squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([s.numel()])])
    avg_rank = (starts + ends + 1).double() / 2
    ranks = avg_rank[run_id]
    pos_rank_sum = float(ranks[pos[order]].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross entropy of ``sigmoid(logits)`` against 0/1 ``labels``."""
    return float(F.binary_cross_entropy_with_logits(logits.detach().reshape(-1).double(),
                                                    labels.detach().reshape(-1).double()))
