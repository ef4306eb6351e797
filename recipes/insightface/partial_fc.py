"""Partial FC (An et al. 2022; InsightFace's PartialFC v2): each class shard samples the centres it uses.

Per forward in training, every shard of the class-split FC weight (the
ranks holding one row range; ranks that hold the same rows draw the same
sample) keeps

- its *positive* centres: the classes of this batch's labels in its range;
- ``int(sample_rate * rows)`` centres in all (PFC v2's ``num_sample``),
  topped up with the negatives that rank highest in a random order of its
  rows keyed by ``(seed, draw, shard)``; when the positives alone are more,
  just them.

The draw runs on the labels' device and never reads them on the host, so a
GPU step does not wait for its kernels here: shapes cannot depend on how
many positives a batch has. Each shard gathers a fixed number of rows,
``min(rows, max(int(sample_rate * rows), labels))`` (no shard can have more
positives than the batch has labels), and those beyond the sample's count
get class id ``-1``: the head masks their logits to ``-inf``, so they take no
part in the softmax and get exactly zero gradient. When the batch has no
more labels than ``int(sample_rate * rows)`` (many classes per shard), that
is the sample itself and nothing is masked; a global batch of more labels
than that (many ranks beside few classes per shard) makes every shard
compute logits for up to ``min(rows, labels)`` columns, where PFC v2, reading
the labels on the host, computes about ``max(int(sample_rate * rows),
labels / shards)``. A split's pieces must be balanced, so shards with fewer
rows pad to the widest shard's count ``k`` with zero rows of id ``-1``.
Every rank computes ``k`` from the shard sizes and the label count alone:
no communication.

The order is a counter-based hash of ``(seed, shard)``, the draw counter (a
device tensor) and the row: integer ops, the same bits on any device.
Positives take the largest key, so one ``topk`` returns them first, then the
negatives in random order.

The sampled weight is a global tensor ``[shards * k, E]`` laid out like the
weight (``S(0)`` on the axes that split it), built from each rank's local
rows (``to_global`` with a known shape: no collective); its gradient flows
back into the gathered rows of the weight's local shard, so other rows get
exactly zero. The rows gathered since the optimizer's last step, and which
of them were in a sample, are kept for ``PartialFCSGD`` (``optim.py``),
which leaves the other rows and their optimizer state untouched.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core.layout import local_box
from sbp_core.process_groups import world_rank

_MIX = (6364136223846793005, 1442695040888963407)  # Knuth's MMIX LCG constants: spread (seed, shard)
_M32 = 0xFFFFFFFF
_POSITIVE = torch.iinfo(torch.int64).max  # above every key ``keys`` makes


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


def gathered(rows: int, labels: int, sample_rate: float) -> int:
    """Rows a shard of ``rows`` gathers for a batch of ``labels`` labels: room for its sample, whatever the labels."""
    return min(rows, max(int(sample_rate * rows), labels))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in ``[0, 2**32)``; products stay below
    ``2**63``, so int64 arithmetic is exact on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def keys(n: int, seed: int, draws: torch.Tensor) -> torch.Tensor:
    """Distinct keys in ``[0, 2**63 - 1)`` for rows ``0..n-1``, on ``draws``' device: their order is random per
    ``(seed, draws)`` (``seed`` a host int, ``draws`` an int64 tensor: never read on the host)."""
    if n >= 2 ** 31:
        raise ValueError(f"a class shard of {n} rows: Partial FC draws shards of under 2**31 rows")
    d = draws.to(torch.int64)
    i = torch.arange(n, device=d.device)
    h = _mix32(i ^ (seed & _M32))
    h = _mix32(h ^ (d & _M32))
    h = _mix32(h ^ ((seed >> 32) & _M32) ^ ((d >> 32) & _M32))
    return h * 2 ** 31 + i  # distinct: the row breaks ties of the hash


def draw(n: int, labels: torch.Tensor, start: int, width: int, num: int, seed: int, draws: torch.Tensor):
    """``(rows, kept)``: ``width`` sorted local rows of the shard ``[start, start + n)``, and which of them are in
    the sample (its positives among ``labels``, topped up with negatives to ``num``; with more positives,
    all of them). ``width`` must be at least ``num`` and the positives' count (``gathered`` sees to it)."""
    if n == 0:  # a shard without rows keeps none (and has no row 0 to take the no-op writes below)
        none = torch.empty(0, dtype=torch.int64, device=labels.device)
        return none, none.bool()
    key = keys(n, seed, draws.to(labels.device))
    mine = (labels >= start) & (labels < start + n)
    key = key.scatter_reduce(0, torch.where(mine, labels - start, 0),
                             torch.where(mine, _POSITIVE, -1), "amax")  # -1: below every key, a no-op
    count = (key == _POSITIVE).sum().clamp(min=num)
    top = torch.topk(key, width).indices  # positives first, then negatives in the keys' random order
    rows, order = top.sort()
    return rows, (torch.arange(width, device=top.device) < count)[order]


def mixed_seed(seed: int, shard: int) -> int:
    return (seed * _MIX[0] + shard * _MIX[1]) % (2 ** 63)


def sample(weight, class_ids, labels, sample_rate: float, seed: int, draws):
    """``(sampled weight [shards*k, E], their class ids [shards*k] with -1 outside the sample, local rows
    gathered, which of them are in the sample)``.

    ``weight`` ``[C, E]`` and ``class_ids`` ``[C]`` laid out alike (plain or
    global, rows split or not), ``labels`` replicated, ``draws`` the draw
    counter (an int64 tensor or an int). Nothing is communicated and nothing
    is read on the host. Every rank calling it must be in the weight's
    placement.
    """
    ranges, me = shards_of(weight)
    local_w = weight.to_local() if isinstance(weight, sc.GlobalTensor) else weight
    local_ids = class_ids.to_local() if isinstance(class_ids, sc.GlobalTensor) else class_ids
    if me is None:  # it has no rows to draw from, hence no part of the sampled weight
        raise ValueError(f"rank {world_rank()} is outside the FC weight's placement {weight.placement}: Partial FC "
                         "sampling runs on the FC's ranks only")
    labels = labels.to_local() if isinstance(labels, sc.GlobalTensor) else labels
    labels = labels.reshape(-1).to(local_w.device)
    k = max(gathered(n, labels.numel(), sample_rate) for _, n in ranges)
    start, n = ranges[me]
    width = gathered(n, labels.numel(), sample_rate)
    draws = torch.as_tensor(draws, dtype=torch.int64, device=local_w.device)
    rows, kept = draw(n, labels, start, width, int(sample_rate * n), mixed_seed(seed, me), draws)
    ids = torch.where(kept, local_ids[rows], -1)
    w, pad = local_w[rows], k - width
    if pad:
        w = torch.cat([w, local_w.new_zeros(pad, local_w.shape[1])])
        ids = torch.cat([ids, ids.new_full((pad,), -1)])
    return _declare(weight, class_ids, w, ids, len(ranges), k) + (rows, kept)


def _declare(weight, class_ids, w, ids, shards: int, k: int):
    """The sampled rows as global tensors laid out like ``weight`` / ``class_ids`` (plain ones on one device)."""
    if not isinstance(weight, sc.GlobalTensor):
        return w, ids
    shape = (shards * k,)
    return (sc.to_global(w, weight.placement, weight.sbp, shape=shape + (weight.shape[1],)),
            sc.to_global(ids, class_ids.placement, class_ids.sbp, shape=shape))
