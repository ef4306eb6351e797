"""Initial values of a large ``[rows, cols]`` table drawn per block of rows, each block from its own seed.

``row_block_box(seed, shape, box, draw)`` returns the box ``((row0, rows),
(col0, cols))`` of the table whose rows ``[b * BLOCK, (b + 1) * BLOCK)``
are ``draw(generator, (n, cols))`` with the generator seeded ``seed + b``.
Only the blocks the box overlaps are drawn, so a rank builds its shard of a
class-centre or embedding table (an ``init_shard``: ``sbp_core.distribute_module``)
in ``BLOCK x cols`` temporary memory and time proportional to its rows,
and every layout holds the same values as one device. Plain torch: model
files use it.
"""
from __future__ import annotations

from typing import Callable

import torch

BLOCK = 1 << 16


def row_block_box(seed: int, shape, box, draw: Callable, block: int = BLOCK) -> torch.Tensor:
    """The ``box`` of the ``shape = (rows, cols)`` table drawn block by block (module docstring), on the CPU in
    the default dtype. ``draw(generator, (n, cols)) -> tensor``, a CPU tensor."""
    rows, cols = shape
    (r0, nr), (c0, nc) = box
    out = torch.empty(nr, nc, device="cpu")
    gen = torch.Generator()
    for b in range(r0 // block, (r0 + nr + block - 1) // block):
        lo, hi = b * block, min((b + 1) * block, rows)
        gen.manual_seed(seed + b)
        values = draw(gen, (hi - lo, cols))
        a, z = max(lo, r0), min(hi, r0 + nr)
        out[a - r0:z - r0] = values[a - lo:z - lo, c0:c0 + nc]
    return out
