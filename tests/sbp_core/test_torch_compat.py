"""``sbp_core.torch_compat``'s backward of the value-selecting reductions equals the gradient they define.

The reference builds each gradient entry by entry: the upstream gradient
lands at the input position each output value was selected from, zeros
elsewhere. Plain tensors, so it holds on every torch, with or without the
kernel replaced.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import sbp_core  # noqa: F401  (installs the replacement where torch needs it)
from sbp_core.torch_compat import _value_selecting_reduction_backward

g = torch.Generator().manual_seed(11)


def _scattered(grad, dim, indices, sizes):
    """Zeros of ``sizes`` with ``grad[p]`` written at ``p`` whose ``dim`` coordinate is ``indices[p]``."""
    out = torch.zeros(sizes)
    for p in itertools.product(*(range(n) for n in indices.shape)):
        q = list(p)
        q[dim] = int(indices[p])
        out[tuple(q)] = grad[p]
    return out


SELECTIONS = {
    "max": lambda x, d, k: x.max(d, keepdim=k),
    "min": lambda x, d, k: x.min(d, keepdim=k),
    "topk": lambda x, d, k: x.topk(2, d),
    "sort": lambda x, d, k: x.sort(d, descending=True),
    "kthvalue": lambda x, d, k: x.kthvalue(2, d, keepdim=k),
    "median": lambda x, d, k: x.median(d, keepdim=k),
}


@pytest.mark.parametrize("name", sorted(SELECTIONS))
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_selection_gradients_land_where_values_were_taken(name, dim, keepdim):
    x = torch.randn(4, 5, generator=g, requires_grad=True)
    values, indices = SELECTIONS[name](x, dim, keepdim)
    upstream = torch.randn(values.shape, generator=g)
    values.backward(upstream)
    kept = name in ("topk", "sort") or keepdim
    up, idx = (upstream, indices) if kept else (upstream.unsqueeze(dim), indices.unsqueeze(dim))
    expected = _scattered(up, dim, idx, x.shape)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        _value_selecting_reduction_backward(upstream, dim, indices, list(x.shape), kept), expected, rtol=0, atol=0)
