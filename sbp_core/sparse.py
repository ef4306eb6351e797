"""Sparse (COO) global tensors: the row gradients of embedding tables.

``F.embedding(..., sparse=True)`` / ``nn.Embedding(sparse=True)`` give a
table a sparse gradient: the looked-up row ids and one gradient row each,
instead of a dense ``[V, d]`` tensor. On global tensors autograd builds it
with ``_sparse_coo_tensor_with_dims_and_tensors(indices, values)``, whose
rule (``ops/sparse.py``) makes a :class:`SparseGlobalTensor`.

Layout contract. A sparse global tensor is a pair: ``indices``
(``[sparse_dim, nnz]``) that are *the same on every member* and a dense
global tensor of ``values`` (``[nnz, *dense dims]``). Its SBP per mesh axis
is ``B`` (values ``B``) or ``S(k)`` on a dense dim ``k >= sparse_dim``
(values ``S(k - sparse_dim + 1)``): each rank holds every entry and a slice
of each entry's columns. Rows are never split: a gradient of a
vocabulary-split (``S(0)``) table stays ``B`` (every rank holds the step's
looked-up rows, a few per sample) and the optimizer takes the rows of its
shard (``rows_in_box``). There is no partial sparse layout: values that
arrive split over the entries (ids split over data parallel) are gathered
when the tensor is made, which is what a sparse all-reduce sends.

Boxing changes the values' layout only (``to_global``). Ops: ``detach``,
``clone``, ``coalesce``, ``_indices``/``_values`` (global tensors: indices
``B``, values as above), ``add``/``add_`` of two sparse tensors (the other
boxed to this one's layout), ``mul``/``mul_`` by a number or a ``B`` scalar,
``zero_``, ``to_dense`` (a dense global tensor in the same layout), and the
metadata queries autograd uses; any other op raises ``NoSbpRule`` naming it.
Nothing here communicates except boxing the values.
"""
from __future__ import annotations

import torch

from .global_tensor import GlobalTensor, NoSbpRule
from .layout import Layout, local_box, local_shape
from .process_groups import world_rank
from .sbp import Broadcast, Split, format_sbp, nd_sbp

aten = torch.ops.aten
_B = Broadcast()


def check_sparse_sbp(sbp: tuple, sparse_dim: int) -> None:
    """A sparse layout is ``B`` or a split of a dense dim on every mesh axis."""
    for s in sbp:
        if s.is_partial or (s.is_split and s.axis < sparse_dim):
            raise ValueError(f"sparse global tensors are laid out B or S(k) with k >= sparse_dim={sparse_dim} "
                             f"on every mesh axis (rows are never split, entries never partial); got "
                             f"{format_sbp(sbp)}")


def values_sbp(sbp: tuple, sparse_dim: int) -> tuple:
    """The values' SBP of a sparse layout (a split of dense dim ``k`` is values dim ``k - sparse_dim + 1``)."""
    return tuple(Split(s.axis - sparse_dim + 1) if s.is_split else _B for s in sbp)


def sparse_sbp_for(sbp: tuple) -> tuple:
    """The sparse layout of a gradient for a parameter laid out ``sbp``: its row splits become ``B``."""
    return tuple(s if s.is_split and s.axis >= 1 else _B for s in sbp)


class SparseGlobalTensor(GlobalTensor):
    """A global tensor whose local is a sparse COO tensor (see the module docstring)."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False, strides=None):
        if not local.is_sparse:
            raise TypeError(f"SparseGlobalTensor needs a sparse COO local, got layout {local.layout}")
        check_sparse_sbp(layout.sbp, local.sparse_dim())
        out = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=layout.dtype, device=local.device,
                                                  layout=torch.sparse_coo, requires_grad=requires_grad)
        out._local = local
        out._layout = layout
        return out

    def __repr__(self, *, tensor_contents=None):
        return (f"SparseGlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, sbp={format_sbp(self.sbp)}, "
                f"{self.placement}, nnz={self._local._nnz()})")

    def to_local(self) -> torch.Tensor:
        """This rank's sparse COO shard (not differentiable: sparse globals are gradients)."""
        return self._local

    def values_global(self) -> GlobalTensor:
        """The values as a dense global tensor ``[nnz, *dense dims]`` (indices are the same everywhere)."""
        return _values(self)

    def to_global(self, placement=None, sbp=None) -> "SparseGlobalTensor":
        """The same sparse value with its values boxed to the layout ``sbp`` implies (same placement only)."""
        if placement is not None and placement != self.placement:
            raise ValueError(f"sparse global tensors box within their placement only: {self.placement} -> {placement}")
        sbp = self.sbp if sbp is None else nd_sbp(sbp, self.placement.ndim)
        sd = self._local.sparse_dim()
        check_sparse_sbp(sbp, sd)
        if sbp == self.sbp:
            return self
        vals = _values(self).to_global(sbp=values_sbp(sbp, sd))
        return _make(self._local._indices(), vals, self.shape, Layout(self.placement, sbp, self.shape, self.dtype),
                     self._local.is_coalesced())

    def full_tensor(self) -> torch.Tensor:
        """The whole sparse tensor (a plain sparse COO tensor) on every member."""
        return self.to_global(sbp=tuple(_B for _ in self.sbp))._local

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _OPS.get(func)
        if handler is None:
            raise NoSbpRule(f"{func} has no rule for sparse global tensors; they support "
                            f"{sorted(str(f) for f in _OPS)}")
        return handler(*args, **(kwargs or {}))


def _make(indices: torch.Tensor, values: GlobalTensor, shape, layout: Layout, coalesced: bool = False):
    """A sparse global from same-everywhere ``indices`` and this rank's values (laid out ``layout``'s values SBP)."""
    me = world_rank()
    if me in layout.placement:
        lshape = local_shape(shape, layout.placement.shape, layout.sbp, layout.placement.coords(me))
        vals = values._local
    else:  # an empty sparse tensor of the same sparse and dense dims (a non-member's indices are empty)
        sd = len(shape) - values.dim() + 1
        lshape, vals = (0,) * len(shape), values._local.new_zeros((0,) * values.dim())
        indices = indices.new_zeros(sd, 0)
    local = torch.sparse_coo_tensor(indices, vals, lshape, is_coalesced=coalesced, check_invariants=False)
    return SparseGlobalTensor(local, layout)


def from_indices_values(indices: GlobalTensor, values: GlobalTensor, size) -> SparseGlobalTensor:
    """``torch.sparse_coo_tensor(indices, values, size)`` for global ``indices``/``values``.

    Indices are boxed to ``B`` (an all-gather of the ids when they are split);
    values keep splits of their dense dims and are boxed to ``B`` elsewhere
    (an all-gather when they are split over the entries or partial).
    """
    if not isinstance(indices, GlobalTensor) or not isinstance(values, GlobalTensor):
        raise TypeError("a sparse global tensor needs global indices and values "
                        f"(got {type(indices).__name__} and {type(values).__name__})")
    p = values.placement
    if indices.placement != p:
        raise ValueError(f"indices on {indices.placement} and values on {p}: box one of them first")
    sd = indices.shape[0]
    b = tuple(_B for _ in p.shape)
    idx = indices if indices.sbp == b else indices.to_global(sbp=b)
    vsbp = tuple(s if s.is_split and s.axis >= 1 else _B for s in values.sbp)
    vals = values if values.sbp == vsbp else values.to_global(sbp=vsbp)
    sbp = tuple(Split(s.axis + sd - 1) if s.is_split else _B for s in vsbp)
    return _make(idx._local, vals, torch.Size(size), Layout(p, sbp, torch.Size(size), values.dtype))


# -- ops ----------------------------------------------------------------------------------


def _rewrap(x: SparseGlobalTensor, local: torch.Tensor) -> SparseGlobalTensor:
    return SparseGlobalTensor(local, x._layout)


def _values(x: SparseGlobalTensor) -> GlobalTensor:
    sd = x._local.sparse_dim()
    shape = torch.Size((x._local._nnz(),) + tuple(x.shape[sd:]))
    return GlobalTensor(x._local._values(), Layout(x.placement, values_sbp(x.sbp, sd), shape, x.dtype))


def _indices(x: SparseGlobalTensor) -> GlobalTensor:
    idx = x._local._indices()
    return GlobalTensor(idx, Layout(x.placement, tuple(_B for _ in x.sbp), idx.shape, idx.dtype))


def _other_local(x: SparseGlobalTensor, other):
    if isinstance(other, SparseGlobalTensor):
        if other.placement != x.placement:
            raise ValueError(f"adding sparse tensors on {x.placement} and {other.placement}")
        return other.to_global(sbp=x.sbp)._local
    raise NoSbpRule(f"sparse global tensors add only sparse global tensors, got {type(other).__name__}")


def _scalar_local(x: SparseGlobalTensor, other):
    if isinstance(other, GlobalTensor):
        if other.dim() != 0 or any(not s.is_broadcast for s in other.sbp) or other.placement != x.placement:
            raise NoSbpRule(f"a sparse global tensor multiplies by a number or a B scalar on its placement, got "
                            f"shape {tuple(other.shape)} sbp {format_sbp(other.sbp)} on {other.placement}")
        return other._local
    if isinstance(other, torch.Tensor) and other.dim() != 0:
        raise NoSbpRule(f"a sparse global tensor multiplies by a number or a scalar, got shape {tuple(other.shape)}")
    return other


def _add(x, other, *, alpha=1):
    return _rewrap(x, x._local.add(_other_local(x, other), alpha=alpha))


def _add_(x, other, *, alpha=1):
    x._local = x._local.add(_other_local(x, other), alpha=alpha)  # sparse add_ may reallocate; keep the result
    return x


def _mul(x, other):
    return _rewrap(x, x._local.mul(_scalar_local(x, other)))


def _mul_(x, other):
    x._local.mul_(_scalar_local(x, other))
    return x


def _to_dense(x, *args, **kwargs):
    dense = x._local.to_dense()
    return GlobalTensor(dense, x._layout)


def _coalesce(x):
    return _rewrap(x, x._local.coalesce())


_OPS = {
    aten.detach.default: lambda x: _rewrap(x, x._local.detach()),
    aten.alias.default: lambda x: _rewrap(x, x._local),
    aten.clone.default: lambda x, memory_format=None: _rewrap(x, x._local.clone()),
    aten.coalesce.default: _coalesce,
    aten._coalesce.default: _coalesce,
    aten.is_coalesced.default: lambda x: x._local.is_coalesced(),
    aten._coalesced_.default: lambda x, c: (x._local._coalesced_(c), x)[1],
    aten._indices.default: _indices,
    aten.indices.default: _indices,
    aten._values.default: _values,
    aten.values.default: _values,
    aten._nnz.default: lambda x: x._local._nnz(),
    aten.sparse_dim.default: lambda x: x._local.sparse_dim(),
    aten.dense_dim.default: lambda x: x._local.dense_dim(),
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_,
    aten.mul.Tensor: _mul,
    aten.mul_.Tensor: _mul_,
    aten.zero_.default: lambda x: (x._local.zero_(), x)[1],
    aten._to_dense.default: _to_dense,
}


def rows_in_box(grad: SparseGlobalTensor | torch.Tensor, shape, mesh_shape, sbp, coords) -> tuple:
    """This rank's rows of a row gradient, for a parameter shard laid out ``sbp`` at ``coords``.

    Returns ``(rows, values)``: ``rows`` the local row indices (into the
    shard, unique, ascending) and ``values`` ``[len(rows), *shard's other
    dims]``, from the coalesced gradient. ``grad`` is a sparse global tensor
    (or, on one device, a plain sparse tensor: then ``sbp=()`` and the shard
    is the whole tensor); its layout must hold every column of the shard.
    """
    if isinstance(grad, SparseGlobalTensor):
        local = grad._local.coalesce()
        gbox = local_box(grad.shape, grad.placement.shape, grad.sbp, coords)
    else:
        local = grad.coalesce()
        gbox = tuple((0, n) for n in grad.shape)
    if local.sparse_dim() != 1:
        raise ValueError(f"row gradients have one sparse dim, got {local.sparse_dim()}")
    pbox = local_box(shape, mesh_shape, sbp, coords) if sbp else tuple((0, n) for n in shape)
    rows, vals = local._indices()[0], local._values()
    (r0, nr) = pbox[0]
    if (r0, nr) != (0, shape[0]):  # else the shard has every row: no host read
        # Coalesced rows ascend: the shard's are one run of them, found with one host read (a mask would
        # take one to test it and one per masked index on a GPU).
        lo, hi = torch.searchsorted(rows, torch.tensor([r0, r0 + nr], device=rows.device)).tolist()
        if (lo, hi) != (0, rows.numel()):
            rows, vals = rows[lo:hi], vals[lo:hi]
    for d in range(1, len(shape)):
        (g0, gn), (p0, pn) = gbox[d], pbox[d]
        if p0 < g0 or p0 + pn > g0 + gn:
            raise ValueError(f"the gradient's shard (dim {d}: {g0}..{g0 + gn}) lacks columns {p0}..{p0 + pn} "
                             "of the parameter's shard")
        if (p0, pn) != (g0, gn):
            vals = vals.narrow(d, p0 - g0, pn)
    return rows - r0, vals
