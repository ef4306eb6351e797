"""The margin-softmax classification head over class centres, plain torch plus Partial FC's sampling.

``MarginSoftmaxHead(num_classes, embedding_size, margin, sample_rate)(emb, labels)``
is the mean cross-entropy of ``margin(cos(emb_i, w_c))`` over the classes
(``margin``: ``margin.CombinedMargin``, scale included):

- ``weight`` ``[C, E]`` holds the class centres (``N(0, 0.01)`` like
  InsightFace, drawn per block of rows from a seed the run seed decides, so
  that any class shard can be built alone: ``init_shard``; with ``meta``
  the weight stays on the meta device and ``sbp_core.distribute_module``
  builds each rank's shard, never the whole table); ``class_ids`` (a
  buffer, ``arange(C)``, on the meta device with the weight and built
  shard by shard the same way) is laid out like its rows, so the target mask
  ``labels[:, None] == class_ids`` is computed where the logits are,
  without knowing the layout;
- cosines ``normalize(emb) @ normalize(weight).T`` clamped to ``[-1, 1]``
  (at least fp32 under autocast, as PartialFC does); each row's target
  cosine (a masked row sum) goes through ``margin`` and replaces the target
  entry; every logit is scaled by ``margin.s``;
- the loss ``-sum(target mask * log_softmax(logits)) / N``.

Under the recipe's plan (``plan.py``) ``weight`` and ``class_ids`` are
``S(0)`` over every mesh axis and ``emb``/``labels`` ``B``, so the logits are
``S(1)``; the target cosines are a ``P(sum)`` ``[N, 1]`` that the plan pins
``B`` at ``head.margin:input`` (one all-reduce of ``N`` values, and their
gradient expands back onto the split logits without traffic); log-softmax
runs as sbp_core's class-split softmax: a row ``max`` (``P(max)``) and a row
sum of exponentials (``P(sum)``) reduced across shards, ``[N, 1]`` each,
never the logits.

With ``sample_rate < 1`` in training, each class shard uses only its
Partial FC sample of centres (``partial_fc.sample``); padding columns (class
id ``-1``) are masked to ``-inf``. ``sampled_rows()`` hands the optimizer the
local rows gathered since the last call and which of them were sampled. The
sampling seed is drawn from the default generator at construction (so it
follows the run seed) and the draw counter is a buffer (checkpointed: a
resumed run draws what the straight run would have).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.row_blocks import row_block_box

from . import partial_fc
from .margin import CombinedMargin


def _normal_centres(gen, shape) -> torch.Tensor:
    return torch.empty(shape, device="cpu").normal_(0.0, 0.01, generator=gen)


class MarginSoftmaxHead(nn.Module):
    def __init__(self, num_classes: int, embedding_size: int, margin: CombinedMargin, sample_rate: float = 1.0,
                 meta: bool = False):
        super().__init__()
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate {sample_rate} must be in (0, 1]")
        self.margin, self.sample_rate = margin, float(sample_rate)
        # Host values drawn from the default generator, whatever the default device (the run seed decides them).
        self.init_seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
        self.seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size, device="meta"))
        self.register_buffer("class_ids", torch.empty(num_classes, dtype=torch.int64, device="meta"),
                             persistent=False)
        if not meta:
            self.weight = nn.Parameter(self.init_shard("weight", ((0, num_classes), (0, embedding_size))))
            self.class_ids = self.init_shard("class_ids", ((0, num_classes),))
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        self._touched = None  # (mask of the sampled local rows, the rows gathered) since the last sampled_rows()

    def init_shard(self, name: str, box) -> torch.Tensor:
        """``weight``: the box ``((row0, rows), (col0, cols))`` of the initial class centres, drawn per block
        of rows (``toolkit.row_blocks``): a class shard is built alone, in time and memory for its rows.
        ``class_ids``: the box ``((row0, rows),)`` of ``arange(C)``."""
        if name == "class_ids":
            ((row0, rows),) = box
            return torch.arange(row0, row0 + rows)
        if name != "weight":
            raise KeyError(f"{type(self).__name__} has no tensor {name!r} to build by box "
                           "(only 'weight' and 'class_ids')")
        return row_block_box(self.init_seed, tuple(self.weight.shape), box, _normal_centres)

    def forward(self, emb, labels):
        weight, ids = self.weight, self.class_ids
        sampling = self.training and self.sample_rate < 1.0 and torch.is_grad_enabled()
        if sampling:
            weight, ids, rows, kept = partial_fc.sample(weight, ids, labels, self.sample_rate, self.seed,
                                                        self._local(self.draws))
            self.draws.add_(1)
            self._mark(rows, kept)
        cos = F.linear(F.normalize(emb), F.normalize(weight))
        cos = cos.to(torch.promote_types(cos.dtype, torch.float32)).clamp(-1.0, 1.0)
        target = labels[:, None] == ids[None, :]
        t = torch.where(target, cos, 0.0).sum(1, keepdim=True)  # each row's target cosine
        logits = torch.where(target, self.margin(t), cos) * self.margin.s
        if sampling:
            logits = torch.where(ids[None, :] >= 0, logits, float("-inf"))
        logp = F.log_softmax(logits, dim=1)
        return -torch.where(target, logp, 0.0).sum(1).mean()

    @staticmethod
    def _local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def _mark(self, rows: torch.Tensor, kept: torch.Tensor) -> None:
        n = self._local(self.weight).shape[0]
        if self._touched is None or self._touched[0].numel() != n:
            self._touched = (torch.zeros(n, dtype=torch.bool, device=rows.device), [])
        mask, gathered = self._touched
        mask[rows] |= kept  # rows are distinct: a plain gather and scatter, no mask indexing
        gathered.append(rows)

    def sampled_rows(self):
        """``(rows, kept)`` since the last call: the local rows of ``weight`` the forwards gathered (a row
        gathered by several forwards repeats) and whether each was in a sample (``None``: every row; no
        sampling). Both stay on the device: nothing is read on the host."""
        if self.sample_rate >= 1.0:
            return None
        touched, self._touched = self._touched, None
        if touched is None:
            none = torch.empty(0, dtype=torch.int64, device=self._local(self.weight).device)
            return none, none.bool()
        mask, gathered = touched
        rows = torch.cat(gathered)
        return rows, mask[rows]
