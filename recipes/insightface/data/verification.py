"""Face verification metrics over pairs: accuracy (k-fold threshold, LFW protocol) and TAR at a FAR.

``verification_metrics(emb_a, emb_b, issame)`` compares the cosine
similarity of each pair's embeddings:

- ``verify_acc``: the LFW protocol's accuracy: the pairs are cut into
  ``folds`` contiguous folds; for each, the threshold that classifies the
  other folds best is applied to it; the mean over folds;
- ``tar_at_far_1e-3``: the fraction of same-identity pairs scoring above
  the threshold that at most ``far`` of the different-identity pairs pass
  (with fewer than ``1 / far`` negative pairs: none of them);
- ``verify_threshold``: the best threshold over all pairs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _best_threshold(scores: torch.Tensor, same: torch.Tensor) -> tuple:
    """``(threshold, accuracy)`` maximising accuracy of ``score > threshold`` on these pairs."""
    order = scores.argsort()
    s, y = scores[order].double(), same[order]
    # Threshold just below sorted score i: pairs i.. are accepted.
    pos_above = y.flip(0).cumsum(0).flip(0).double()  # positives at or above i
    neg_below = torch.cat([torch.zeros(1, dtype=torch.float64), (~y).cumsum(0).double()])[:-1]
    correct = pos_above + neg_below
    all_rejected = float((~y).sum())
    i = int(correct.argmax())
    if all_rejected >= float(correct[i]):
        return float(s[-1]) + 1e-6, all_rejected / len(y)
    below = float(s[i - 1]) if i > 0 else float(s[i]) - 1e-6
    return (below + float(s[i])) / 2, float(correct[i]) / len(y)


def tar_at_far(scores: torch.Tensor, same: torch.Tensor, far: float) -> float:
    neg = scores[~same].double().sort(descending=True).values
    pos = scores[same].double()
    if len(pos) == 0:
        raise ValueError("TAR needs at least one same-identity pair")
    allowed = math.floor(far * len(neg))  # false accepts allowed
    threshold = float(neg[allowed]) if allowed < len(neg) else -math.inf
    return float((pos > threshold).double().mean())


def verification_metrics(emb_a, emb_b, issame, folds: int = 10, far: float = 1e-3) -> dict:
    if not (len(emb_a) == len(emb_b) == len(issame)) or len(issame) < 2:
        raise ValueError(f"need matching pairs (at least 2): {len(emb_a)}, {len(emb_b)}, {len(issame)}")
    scores = (F.normalize(emb_a.double(), dim=1) * F.normalize(emb_b.double(), dim=1)).sum(1)
    same = issame.bool()
    folds = max(1, min(folds, len(same) // 2))
    accs = []
    for test in torch.arange(len(same)).tensor_split(folds):
        train = torch.ones(len(same), dtype=torch.bool)
        train[test] = False
        threshold, _ = _best_threshold(scores[train], same[train]) if folds > 1 else _best_threshold(scores, same)
        accs.append(float(((scores[test] > threshold) == same[test]).double().mean()))
    threshold, _ = _best_threshold(scores, same)
    return {"verify_acc": sum(accs) / len(accs), f"tar_at_far_{far:.0e}".replace("e-0", "e-"): tar_at_far(scores, same, far),
            "verify_threshold": threshold}
