"""Making sparse global tensors: ``_sparse_coo_tensor_with_dims_and_tensors``.

What autograd calls for the gradient of ``F.embedding(..., sparse=True)``
(``embedding_sparse_backward``: the ids as indices, the output gradient's
rows as values), and what ``torch.sparse_coo_tensor`` reaches. Always
decomposed into ``sbp_core.sparse.from_indices_values``: indices boxed to
``B``; values keep splits of their dense dims, other axes boxed to ``B``
(ids split over data parallel: their rows are all-gathered, a sparse
all-reduce); the result is ``S(k)`` where the values split dense dim ``k``,
``B`` elsewhere. So a column-split table (``S(1)``, ids ``B``) gets an
``S(1)`` gradient with no communication, and a vocabulary-split table
(``S(0)``) a ``B`` one holding the step's rows.
"""
from __future__ import annotations

import torch

from ..sparse import from_indices_values
from .registry import register

aten = torch.ops.aten


def _sparse_coo(sparse_dim, dense_dim, size, indices, values, **_options):
    return from_indices_values(indices, values, size)


def _never_decided(call):
    raise AssertionError(f"{call.func} is always decomposed")


register(aten._sparse_coo_tensor_with_dims_and_tensors.default, decompose=_sparse_coo,
         decompose_when=lambda call: True)(_never_decided)
