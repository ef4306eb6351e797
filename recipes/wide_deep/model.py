"""Wide&Deep (Cheng et al. 2016) for Criteo-layout data, as plain torch modules.

``WideDeep(WideDeepConfig(...))(dense, ids) -> logits``:

- ``dense``: ``[b, n_dense]`` float features (already transformed, e.g.
  ``log1p`` of Criteo's counts); ``ids``: ``[b, n_fields]`` int64 rows of
  the embedding tables, already hashed into ``[0, table_rows)`` (see
  ``hashing``);
- wide part: ``wide``, a ``[table_rows, 1]`` table; its logit is the sum of
  the looked-up weights (a linear model over the one-hot categories);
- deep part: ``deep``, a ``[table_rows, embed_dim]`` table; the looked-up
  rows, flattened, with ``dense`` feed ``mlp`` (``Linear``-``ReLU``-
  ``Dropout`` blocks, then a ``Linear`` to one logit);
- the logit is wide + deep; the loss (the recipe's) is sigmoid BCE.

Tables give sparse gradients (``sparse=True``: only looked-up rows) unless
``sparse_grad`` is off. Their initial values are a function of the seed and
the row block (:class:`BlockInitEmbedding`), so any shard can be built
alone: with ``meta_tables`` the tables are created on the meta device and
``sbp_core.distribute_module`` asks ``init_shard`` for each rank's box,
never building a whole table on one rank.

No communication here: the parallel plan (``plan.py``) lays the tables out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.row_blocks import row_block_box


@dataclass
class WideDeepConfig:
    n_dense: int = 13
    n_fields: int = 26
    table_rows: int = 100_000
    embed_dim: int = 16
    hidden: list = field(default_factory=lambda: [1024] * 7)
    dropout: float = 0.5
    init_scale: float = 0.05
    sparse_grad: bool = True
    meta_tables: bool = False


class BlockInitEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised ``U(-scale, scale)`` per block of rows, each from its own seed.

    ``init_shard("weight", ((row0, rows), (col0, cols)))`` returns that box of
    the initial table by drawing only the blocks it overlaps
    (``toolkit.row_blocks``), so a shard costs ``BLOCK x dim`` temporary
    memory, not the table. The seed is drawn
    from torch's default generator at construction (same seed -> same
    tables on every rank).
    """

    def __init__(self, rows: int, dim: int, scale: float, sparse: bool, meta: bool):
        super().__init__(rows, dim, sparse=sparse, device="meta")
        self.scale = float(scale)
        self.seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))  # a number even when built on meta
        if not meta:
            self.weight = nn.Parameter(self.init_shard("weight", ((0, rows), (0, dim))))

    def reset_parameters(self) -> None:  # nn.Embedding's normal_ init; ours is init_shard
        pass

    def init_shard(self, name: str, box) -> torch.Tensor:
        if name != "weight":
            raise KeyError(f"{type(self).__name__} has no parameter {name!r} (only 'weight')")
        return row_block_box(self.seed, (self.num_embeddings, self.embedding_dim), box, self._draw)

    def _draw(self, gen, shape) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device="cpu").mul_(2 * self.scale).sub_(self.scale)


class WideDeep(nn.Module):
    def __init__(self, cfg: WideDeepConfig):
        super().__init__()
        self.cfg = cfg
        self.wide = BlockInitEmbedding(cfg.table_rows, 1, cfg.init_scale, cfg.sparse_grad, cfg.meta_tables)
        self.deep = BlockInitEmbedding(cfg.table_rows, cfg.embed_dim, cfg.init_scale, cfg.sparse_grad,
                                       cfg.meta_tables)
        layers, width = [], cfg.n_dense + cfg.n_fields * cfg.embed_dim
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(cfg.dropout)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[b]``."""
        wide = self.wide(ids).sum(dim=(1, 2))
        deep_in = torch.cat([dense, self.deep(ids).flatten(1)], dim=1)
        return wide + self.mlp(deep_in).squeeze(-1)


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean sigmoid binary cross-entropy (labels 0/1, any float dtype)."""
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
