"""Running aten ops on global tensors: the hot path of ``GlobalTensor.__torch_dispatch__``.

Each call builds a cache key from the op and its arguments, each global
tensor contributing its (interned) ``Layout`` object, so the key is a tuple
hashed in C; a call on one or two global tensors and nothing else (most of a
model's ops) builds that tuple directly, the others through a list (0.2 us
less for ``add``/``relu``, 0.05 us more for the rest). A miss goes to
``decide`` (the rule, the costed choice of signature, the meta run for
output shapes), which validates the call; a hit re-validates nothing,
because the same layouts passed validation when the entry was made. A hit
on a ``plain`` decision (member rank, no boxing, no custom local) runs
``func(*locals)`` and wraps the result with the decision's precomputed
output layout and device. A rank outside the placement computes nothing and
holds empty locals.

What the key holds of non-tensor arguments: the values themselves, lists as
tuples, floats only as zero or not (see ``_float_part``), 0-d local tensors
by dtype. An argument list that nests tensors (``cat``, ``index``) takes the
pytree path, ``_dispatch_nested``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .boxing import box
from .decide import WRAP_ONE, WRAP_SEQ, decide, mixed_local
from .global_tensor import GlobalTensor, wrap

_make_wrapper = torch.Tensor._make_wrapper_subclass
_strided = torch.strided
from .process_groups import world_rank
from .sbp import format_sbp

aten = torch.ops.aten
_Tensor = torch.Tensor
_SCALAR = aten._local_scalar_dense.default

_cache: dict = {}
_CACHE_LIMIT = 1 << 16
_explain: list = []

# Float arguments count only as zero or not: optimizers pass step-dependent
# floats (``addcdiv_(value=-step_size)``) and no rule reads more of a float
# than that, so keying on the value would re-decide every step and grow the
# cache without bound.
_FLOAT_ZERO, _FLOAT = object(), object()
_LOCAL_0D = object()  # marks a 0-d local tensor (a scalar); its dtype follows in the key


class _Nested(Exception):
    """An argument nests tensors (e.g. ``cat``'s list): take the pytree path."""


@contextlib.contextmanager
def decisions(cache: dict):
    """Inside, signature decisions are cached in ``cache`` (e.g. a rehearsal's fake worlds keep theirs apart)."""
    global _cache
    saved, _cache = _cache, cache
    try:
        yield
    finally:
        _cache = saved


def _key_kwargs(func, kwargs, key) -> None:
    for k, a in kwargs.items():
        key.append(k)
        t = type(a)
        if t is float:
            key.append(_FLOAT_ZERO if a == 0.0 else _FLOAT)
        elif t is list or t is tuple:
            if a and (a[0] is None or isinstance(a[0], _Tensor)):
                raise _Nested
            key.append(tuple(a))
        elif isinstance(a, _Tensor):
            if isinstance(a, GlobalTensor):
                key.append(a._layout)
            elif a.dim() == 0:
                key.append(_LOCAL_0D)
                key.append(a.dtype)
            else:
                mixed_local(func, a)
        else:
            key.append(a)


def _miss(func, args, kwargs, key):
    """Decide (and validate) a call whose key is not cached yet; cache the decision."""
    try:
        hash(key)
    except TypeError:  # an unhashable argument: decide afresh, do not cache
        return decide(func, args, kwargs)
    d = decide(func, args, kwargs)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = d
    return d


def dispatch(func, types, args=(), kwargs=None):
    """``GlobalTensor.__torch_dispatch__`` (a staticmethod: torch then calls this function as it is,
    with no bound method made per op). Kept flat on purpose: every Python frame and bytecode here
    is paid per op (``python scripts/bench_dispatch.py`` measures it; docs/performance.md)."""
    n = len(args)
    if n == 1 and not kwargs and type(args[0]) is GlobalTensor:  # unary ops: the key without a list
        a = args[0]
        key = (id(func), a._layout)
        loc = [a._local]
    elif n == 2 and not kwargs and type(args[0]) is GlobalTensor and type(args[1]) is GlobalTensor:  # binary
        a, b = args
        key = (id(func), a._layout, b._layout)
        loc = [a._local, b._local]
    else:
        key = [id(func)]
        loc = []  # the arguments with each global tensor replaced by its local
        try:
            for a in args:  # branches ordered by how often aten arguments take them
                t = type(a)
                if t is GlobalTensor:
                    key.append(a._layout)
                    loc.append(a._local)
                    continue
                if t is int or t is bool or a is None:
                    key.append(a)
                elif t is list or t is tuple:
                    # aten lists are homogeneous: a tensor list starts with a tensor or (Tensor?[]) None.
                    if a and (a[0] is None or isinstance(a[0], _Tensor)):
                        raise _Nested
                    key.append(tuple(a))
                elif t is float:
                    key.append(_FLOAT_ZERO if a == 0.0 else _FLOAT)
                elif isinstance(a, _Tensor):
                    if isinstance(a, GlobalTensor):  # a subclass
                        key.append(a._layout)
                        loc.append(a._local)
                        continue
                    if a.dim() != 0:
                        mixed_local(func, a)
                    key.append(_LOCAL_0D)
                    key.append(a.dtype)
                else:
                    key.append(a)
                loc.append(a)
            if kwargs:
                _key_kwargs(func, kwargs, key)
        except _Nested:
            return _dispatch_nested(func, args, kwargs or {})
        key = tuple(key)
    try:
        d = _cache[key]
    except (KeyError, TypeError):
        if func is _SCALAR:  # never cached, so tested here rather than on every op
            return _scalar(args[0])
        d = _miss(func, args, kwargs or {}, key)
    if _explain:
        _record_explain(func, args, kwargs, d)
    fast = d.fast
    if fast is not None:  # plain, not in place, one tensor out: the common case, tested once
        out = d.call(*loc, **kwargs) if kwargs else d.call(*loc)
        # wrap(out, ...) inlined: one frame less per op; the device comes with the decision.
        shape, strides, dtype, layout, device = fast
        g = _make_wrapper(GlobalTensor, shape, strides, None, None, dtype, _strided, device)
        g._local = out
        g._layout = layout
        return g
    if d.plain:
        out = d.call(*loc, **kwargs) if kwargs else d.call(*loc)
    elif d.direct_local:  # a custom local on unboxed inputs: no need to rebuild the arguments
        out = d.entry.local(func, loc, kwargs or {}, d.ctx)
    else:
        return _run(func, args, kwargs or {}, d)
    if d.inplace:
        return args[0]
    one = d.one
    if one is None:
        return _wrap_many(out, d)
    g = _make_wrapper(GlobalTensor, one[0], one[1], None, None, one[2], _strided, out.device)
    g._local = out
    g._layout = one[3]
    return g


def _record_explain(func, args, kwargs, d) -> None:
    gs = [a for a in args if isinstance(a, GlobalTensor)]
    if kwargs:
        gs += [v for v in kwargs.values() if isinstance(v, GlobalTensor)]
    _explain[-1].append((func, [a._layout.sbp for a in gs], d))


def _run(func, args, kwargs, d):
    """Everything but the plain case: decomposition, boxing inputs, a custom local, a rank outside."""
    if d.decompose:
        return d.entry.decompose(*args, **kwargs)
    globals_ = [a for a in args if isinstance(a, GlobalTensor)]
    if d.kw_globals:
        globals_ += [v for v in kwargs.values() if isinstance(v, GlobalTensor)]
    locals_ = [
        box(x._local, x._layout, lay) if need else x._local
        for x, need, lay in zip(globals_, d.boxes, d.in_layouts)
    ]
    if not d.member:
        return _outside(args, globals_, d)
    it = iter(locals_)
    largs = [next(it) if isinstance(a, GlobalTensor) else a for a in args]
    if d.kw_globals:
        kwargs = {k: next(it) if isinstance(v, GlobalTensor) else v for k, v in kwargs.items()}
    out = d.entry.local(func, largs, kwargs, d.ctx) if d.ctx is not None else d.call(*largs, **kwargs)
    if d.inplace:
        return args[0]
    return _wrap_many(out, d)


def _wrap_many(out, d):
    """Outputs other than one tensor: a flat tuple/list (``d.many``: per output what to wrap it with) or a pytree."""
    if d.wrap == WRAP_SEQ:
        res = []
        for o, w in zip(out, d.many):
            if w is None:
                res.append(o)
            else:
                g = _make_wrapper(GlobalTensor, w[0], w[1], None, None, w[2], _strided, o.device)
                g._local = o
                g._layout = w[3]
                res.append(g)
        return tuple(res) if d.seq_type is tuple else res
    if d.wrap == WRAP_ONE:
        return wrap(out, d.out_layouts[0][0], d.out_layouts[0][1])
    res = [o if lay is None else wrap(o, lay[0], lay[1]) for o, lay in zip(tree_flatten(out)[0], d.out_layouts)]
    return tree_unflatten(res, d.out_spec)


def _outside(args, globals_, d):
    """A rank outside the placement: no compute, empty locals of the output dtypes."""
    if d.inplace:
        return args[0]
    device = globals_[0]._local.device
    empty = [None if o is None else torch.empty(0, dtype=o[0].dtype, device=device) for o in d.out_layouts]
    res = [o if lay is None else wrap(o, lay[0], lay[1]) for o, lay in zip(empty, d.out_layouts)]
    return tree_unflatten(res, d.out_spec)


def _dispatch_nested(func, args, kwargs):
    """Ops whose arguments nest tensors in lists (``cat``, ``index``): the pytree path."""
    flat, spec = tree_flatten((args, kwargs))
    key = [id(func), len(flat)]
    for a in flat:
        if isinstance(a, GlobalTensor):
            key.append(a._layout)
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                mixed_local(func, a)
            key.append(a.dtype)
        elif type(a) is float:
            key.append(_FLOAT_ZERO if a == 0.0 else _FLOAT)
        else:
            key.append(a)
    key = tuple(key)
    try:
        d = _cache[key]
    except (KeyError, TypeError):
        d = _miss(func, args, kwargs, key)
    gpos = [i for i, a in enumerate(flat) if isinstance(a, GlobalTensor)]
    if _explain:
        _explain[-1].append((func, [flat[i].sbp for i in gpos], d))
    if d.decompose:
        return d.entry.decompose(*args, **kwargs)
    local_flat = list(flat)
    for j, i in enumerate(gpos):
        x = flat[i]
        local_flat[i] = box(x._local, x._layout, d.in_layouts[j]) if d.boxes[j] else x._local
    if not d.member:
        return _outside(args, [flat[i] for i in gpos], d)
    largs, lkwargs = tree_unflatten(local_flat, spec)
    out = d.entry.local(func, largs, lkwargs, d.ctx) if d.ctx is not None else d.call(*largs, **lkwargs)
    if d.inplace:
        return args[0]
    return _wrap_many(out, d)


def _scalar(x: GlobalTensor):
    """``.item()``: the value needs every axis broadcast."""
    from .sbp import Broadcast

    b = tuple(Broadcast() for _ in x.sbp)
    local = x._local if x.sbp == b else box(x._local, x._layout, x._layout.with_sbp(b))
    if world_rank() not in x.placement:
        raise ValueError(f"rank {world_rank()} is outside {x.placement} and holds no value of this tensor")
    return local.item()


def explaining() -> bool:
    """Whether an ``explain()`` is recording (then every op must take the dispatched path)."""
    return bool(_explain)


@contextlib.contextmanager
def explain():
    """``with sc.explain() as steps:`` records each op's chosen signature and the boxing it caused.

    ``steps`` is a list of ``(op, input sbps, required input sbps, output sbps, planned bytes)``.
    """
    raw: list = []
    _explain.append(raw)
    steps: list = []
    try:
        yield steps
    finally:
        _explain.remove(raw)
        for func, actual, d in raw:
            if d.decompose:
                steps.append((str(func), actual, "decomposed", None, 0.0))
            else:
                outs = [o[0].sbp for o in d.out_layouts if o is not None]
                steps.append((str(func), actual, d.required, outs, d.cost))


def format_explain(steps) -> str:
    lines = []
    for op, actual, req, outs, cost in steps:
        ins = ", ".join(format_sbp(a) for a in actual)
        if req == "decomposed":
            lines.append(f"{op:45s} {ins} -> decomposed")
            continue
        boxed = ", ".join(format_sbp(r) for r in req)
        lines.append(f"{op:45s} {ins} => {boxed} -> {', '.join(format_sbp(o) for o in outs)}  boxing {cost:.0f} B")
    return "\n".join(lines)


# ``dispatch`` itself is the type's hook (a staticmethod: one Python frame per op, no bound method).
GlobalTensor.__torch_dispatch__ = staticmethod(dispatch)
