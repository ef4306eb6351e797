"""Partial FC (An et al. 2022; InsightFace's PartialFC v2): each class shard samples the centres it uses.

Per forward in training, every shard of the class-split FC weight (the
ranks holding one row range; ranks that hold the same rows draw the same
sample) keeps

- its *positive* centres: the classes of this batch's labels in its range;
- ``int(sample_rate * rows)`` centres in all (PFC v2's ``num_sample``),
  topped up with negatives drawn uniformly from a generator seeded by
  ``(seed, draw, shard)``; when the positives alone are more, just them.

Each shard's sample is sorted by class. Shards may keep different counts,
and a split's pieces must be balanced, so every shard pads its rows to the
largest count ``k`` with zero rows whose class id is ``-1`` (the head masks
their logits to ``-inf``: they take no part in the softmax and get no
gradient). Every rank computes every shard's count from the replicated
labels, so ``k`` needs no communication.

The sampled weight is a global tensor ``[shards * k, E]`` laid out like the
weight (``S(0)`` on the axes that split it), built from each rank's local
rows (``to_global`` with a known shape: no collective); its gradient flows
back into the sampled rows of the weight's local shard, so un-sampled rows
get exactly zero. Which rows were sampled since the optimizer's last step is
kept for ``PartialFCSGD`` (``optim.py``), which leaves the other rows and
their optimizer state untouched.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core.layout import local_box
from sbp_core.process_groups import world_rank

_MIX = (6364136223846793005, 1442695040888963407)  # Knuth's MMIX LCG constants: spread (seed, draw, shard)


def shards_of(weight) -> tuple:
    """``(row ranges of every shard, index of this rank's shard)`` of a ``[C, E]`` weight (plain or global).

    Shards are numbered in mesh order over the axes that split dim 0; the
    index is ``None`` on a rank outside the weight's placement.
    """
    if not isinstance(weight, sc.GlobalTensor):
        return [(0, weight.shape[0])], 0
    p, sbp, shape = weight.placement, weight.sbp, weight.shape
    axes = [i for i, s in enumerate(sbp) if s.is_split and s.axis == 0]
    me = world_rank()
    mine = p.coords(me) if me in p else None
    ranges, index = [], None
    for flat in range(_count(p.shape, axes)):
        coords = [0] * p.ndim
        rest = flat
        for i in reversed(axes):
            coords[i], rest = rest % p.shape[i], rest // p.shape[i]
        ranges.append(local_box(shape, p.shape, sbp, coords)[0])
        if mine is not None and all(coords[i] == mine[i] for i in axes):
            index = flat
    return ranges, index


def _count(mesh_shape, axes) -> int:
    n = 1
    for i in axes:
        n *= mesh_shape[i]
    return n


def sample_counts(ranges, classes: torch.Tensor, sample_rate: float) -> list:
    """Rows each shard keeps: ``max(int(sample_rate * rows), classes in its range)`` (``classes``: unique labels)."""
    return [max(int(sample_rate * n), int(((classes >= a) & (classes < a + n)).sum())) for a, n in ranges]


def draw(n: int, positives: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Sorted local row indices: every ``positives`` row plus random others, ``count`` in all."""
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(n, generator=g)
    score[positives] = 2.0  # above any uniform draw: positives always win
    return torch.topk(score, count, sorted=False).indices.sort().values


def mixed_seed(seed: int, draw_index: int, shard: int) -> int:
    return (seed * _MIX[0] + draw_index * _MIX[1] + shard) % (2 ** 63)


def sample(weight, class_ids, labels, sample_rate: float, seed: int, draw_index: int):
    """``(sampled weight [shards*k, E], their class ids [shards*k] with -1 for padding, local rows kept)``.

    ``weight`` ``[C, E]`` and ``class_ids`` ``[C]`` laid out alike (plain or
    global, rows split or not), ``labels`` replicated. Nothing is
    communicated. Every rank calling it must be in the weight's placement.
    """
    ranges, me = shards_of(weight)
    local_w = weight.to_local() if isinstance(weight, sc.GlobalTensor) else weight
    local_ids = class_ids.to_local() if isinstance(class_ids, sc.GlobalTensor) else class_ids
    if me is None:  # it cannot know the labels, hence k, hence the global shape
        raise ValueError(f"rank {world_rank()} is outside the FC weight's placement {weight.placement}: Partial FC "
                         "sampling runs on the FC's ranks only")
    labels = labels.to_local() if isinstance(labels, sc.GlobalTensor) else labels
    # The draw is the host's (its sizes decide k, the global shape): one read of the labels.
    classes = torch.unique(labels.cpu())
    counts = sample_counts(ranges, classes, sample_rate)
    k = max(counts)
    start, n = ranges[me]
    positives = classes[(classes >= start) & (classes < start + n)] - start
    rows = draw(n, positives, counts[me], mixed_seed(seed, draw_index, me)).to(local_w.device)
    pad = k - rows.numel()
    w = torch.cat([local_w[rows], local_w.new_zeros(pad, local_w.shape[1])]) if pad else local_w[rows]
    ids = torch.cat([local_ids[rows], local_ids.new_full((pad,), -1)]) if pad else local_ids[rows]
    return _declare(weight, class_ids, w, ids, len(ranges), k, rows)


def _declare(weight, class_ids, w, ids, shards: int, k: int, rows):
    """The sampled rows as global tensors laid out like ``weight`` / ``class_ids`` (plain ones on one device)."""
    if not isinstance(weight, sc.GlobalTensor):
        return w, ids, rows
    shape = (shards * k,)
    return (sc.to_global(w, weight.placement, weight.sbp, shape=shape + (weight.shape[1],)),
            sc.to_global(ids, class_ids.placement, class_ids.sbp, shape=shape), rows)
