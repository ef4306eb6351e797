"""Creation ops with single-device values: ``sc.randn(..., placement, sbp)``.

Every rank (inside the placement or not) draws the whole tensor from its
default generator, exactly as one device would, and keeps its shard. So with
the same seed on every rank the global value equals ``torch.randn``'s and the
ranks' random streams stay in step. The full draw costs one full tensor of
temporary memory per rank.
"""
from __future__ import annotations

import torch

from .declare import distribute


def _make(fill, size, placement, sbp, dtype, requires_grad):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    full = fill(size, dtype=dtype)
    return distribute(full, placement, sbp, requires_grad=requires_grad)


def randn(*size, placement, sbp, dtype=None, requires_grad=False):
    return _make(torch.randn, size, placement, sbp, dtype, requires_grad)


def rand(*size, placement, sbp, dtype=None, requires_grad=False):
    return _make(torch.rand, size, placement, sbp, dtype, requires_grad)


def zeros(*size, placement, sbp, dtype=None, requires_grad=False):
    return _make(torch.zeros, size, placement, sbp, dtype, requires_grad)


def ones(*size, placement, sbp, dtype=None, requires_grad=False):
    return _make(torch.ones, size, placement, sbp, dtype, requires_grad)
