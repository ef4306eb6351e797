"""Running aten ops on global tensors: pick a signature, box the inputs, run locally, wrap.

``GlobalTensor.__torch_dispatch__`` calls ``dispatch``. On the first call
with given (op, input layouts, shapes, arguments) the op's rule proposes
1-d signatures per mesh axis; their products are costed by the boxing
planner (bytes, DESIGN.md's table) and the cheapest is cached, so later
calls pay one dictionary lookup. Output shapes and strides come from running
the op once on meta tensors. A rank outside the placement computes nothing
and holds empty locals.
"""
from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .boxing import box
from .boxing.nd_plan import plan
from .global_tensor import GlobalTensor, NoSbpRule
from .layout import Layout
from .ops.registry import Call, TensorMeta, lookup
from .process_groups import world_rank
from .sbp import format_sbp

aten = torch.ops.aten


class LocalContext:
    """What a custom local implementation may need: where this rank sits and the chosen signature."""

    __slots__ = ("placement", "coords", "sigs", "in_layouts", "out_layouts")

    def __init__(self, placement, sigs, in_layouts, out_layouts):
        self.placement = placement
        self.coords = placement.coords(world_rank())
        self.sigs = sigs  # one 1-d Sig per mesh axis
        self.in_layouts = in_layouts  # boxed layouts of the global inputs
        self.out_layouts = out_layouts


class Decision:
    __slots__ = ("required", "out_layouts", "out_spec", "entry", "sigs", "decompose", "inplace", "cost",
                 "in_layouts", "member", "boxes", "ctx")


_cache: dict = {}
_explain: list = []


def _describe(flat):
    return [f"{tuple(a.shape)} {format_sbp(a.sbp)}" if isinstance(a, GlobalTensor) else type(a).__name__ for a in flat if isinstance(a, torch.Tensor)]


def _plan_cost(src, dst, placement, shape, dtype) -> float:
    if src == dst:
        return 0.0
    try:
        return plan(src, dst, placement.shape, tuple(shape), dtype.itemsize)[1]
    except ValueError:
        return math.inf


def _decide(func, flat, spec, gpos, placement) -> Decision:
    entry = lookup(func)
    globals_ = [flat[i] for i in gpos]
    if entry is None:
        raise NoSbpRule(
            f"no SBP rule for {func} with inputs {_describe(flat)}: add one in sbp_core/ops, "
            "or box the inputs and run the op on their locals"
        )
    metas = [TensorMeta(x.shape, x.dtype) for x in globals_]
    meta_flat = list(flat)
    rule_flat = list(flat)
    for i, x in zip(gpos, globals_):
        meta_flat[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        rule_flat[i] = TensorMeta(x.shape, x.dtype)
    margs, mkwargs = tree_unflatten(meta_flat, spec)
    if isinstance(mkwargs.get("device"), torch.device):  # e.g. autocast's _to_copy(..., device=cpu)
        mkwargs = {**mkwargs, "device": torch.device("meta")}
    out = func(*margs, **mkwargs)
    out_flat, out_spec = tree_flatten(out)
    rargs, rkwargs = tree_unflatten(rule_flat, spec)
    actual = [x.sbp for x in globals_]
    d = Decision()
    d.entry = entry
    d.inplace = torch.Tag.inplace in func.tags
    d.out_spec = out_spec
    call = Call(func, rargs, rkwargs, metas, 1, 0, placement.shape, actual)
    if entry.decompose_when is not None and entry.decompose_when(call):
        d.decompose = True
        return d
    d.decompose = False
    per_axis = []
    for axis, n in enumerate(placement.shape):
        call.p, call.axis = n, axis
        per_axis.append(entry.rule(call))
    best = None
    for sigs in itertools.product(*per_axis):
        required = [
            tuple(a if s.inputs[j] is None else s.inputs[j] for a, s in zip(actual[j], sigs)) for j in range(len(globals_))
        ]
        if d.inplace and required[0] != actual[0]:
            continue
        cost = sum(_plan_cost(actual[j], required[j], placement, metas[j].shape, metas[j].dtype) for j in range(len(globals_)))
        # Ties (free boxings such as B -> S) go to the signature that changes fewest inputs.
        rank = (cost, sum(r != a for r, a in zip(required, actual)))
        if best is None or rank < best[0]:
            best = (rank, sigs, required)
    if best is None or math.isinf(best[0][0]):
        valid = [" x ".join(f"{[format_sbp((i,)) for i in s.inputs]}->{[format_sbp((o,)) for o in s.outputs]}" for s in sigs) for sigs in itertools.product(*per_axis)]
        raise ValueError(
            f"{func} cannot run with inputs {_describe(flat)}"
            + (" in place" if d.inplace else "")
            + f"; valid signatures per mesh axis: {valid[:12]}"
        )
    (d.cost, _), d.sigs, d.required = best
    d.in_layouts = [x.layout.with_sbp(r) for x, r in zip(globals_, d.required)]
    outs = [o for o in out_flat if isinstance(o, torch.Tensor)]
    d.out_layouts = []
    k = 0
    for o in out_flat:
        if isinstance(o, torch.Tensor):
            sbp = tuple(s.outputs[k] for s in d.sigs)
            d.out_layouts.append((Layout(placement, sbp, o.shape, o.dtype), o.stride()))
            k += 1
        else:
            d.out_layouts.append(None)
    assert k == len(outs)
    return d


_CACHE_LIMIT = 1 << 16


@contextlib.contextmanager
def decisions(cache: dict):
    """Inside, signature decisions are cached in ``cache`` (e.g. a rehearsal's fake worlds keep theirs apart)."""
    global _cache
    saved, _cache = _cache, cache
    try:
        yield
    finally:
        _cache = saved


def _key_part(a):
    """What of a non-tensor argument a decision may depend on.

    Floats count only as zero or not: optimizers pass step-dependent floats
    (``addcdiv_(value=-step_size)``), and no rule reads more of a float than
    that, so keying on the value would re-decide every step and grow the
    cache without bound.
    """
    if type(a) is float:
        return (float, a == 0.0)
    if isinstance(a, list):
        return tuple(a)
    return a


class _Nested(Exception):
    """An argument nests tensors (e.g. ``cat``'s list): take the pytree path."""


def _scan(func, args, kwargs):
    """The decision key and the global inputs, without pytree (the hot path)."""
    key = [func, "flat"]
    globals_ = []
    placement = None
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, GlobalTensor):
            lay = a._layout
            if placement is None:
                placement = lay.placement
            elif lay.placement != placement:
                _mixed(func, placement, lay.placement)
            key.append(lay.sbp)
            key.append(lay.shape)
            key.append(lay.dtype)
            globals_.append(a)
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                _local_mixed(func, a)
            key.append(a.dtype)
        elif isinstance(a, (list, tuple)):
            if any(isinstance(v, torch.Tensor) for v in a):
                raise _Nested
            key.append(tuple(a))
        else:
            key.append(_key_part(a))
    key.extend(kwargs)
    key.append(placement)
    return tuple(key), globals_, placement


def _mixed(func, p1, p2):
    raise ValueError(
        f"{func} mixes global tensors on {p1} and {p2}: box one of them with .to_global(placement=...) first"
    )


def _local_mixed(func, a):
    raise ValueError(
        f"{func} mixes a global tensor with a local {tuple(a.shape)} tensor: "
        "declare it with sc.to_global(local, placement, sbp) first"
    )


def _decision(func, args, kwargs, key):
    """The cached decision for ``key``, deciding (via pytree) on a miss."""
    try:
        d = _cache.get(key)
    except TypeError:  # an unhashable argument: decide afresh, do not cache
        key, d = None, None
    if d is not None:
        return d
    flat, spec = tree_flatten((args, kwargs))
    gpos = [i for i, a in enumerate(flat) if isinstance(a, GlobalTensor)]
    placement = flat[gpos[0]].placement
    for i, a in enumerate(flat):
        if isinstance(a, GlobalTensor) and a.placement != placement:
            _mixed(func, placement, a.placement)
        elif isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() != 0:
            _local_mixed(func, a)
    d = _decide(func, flat, spec, gpos, placement)
    d.member = world_rank() in placement
    if not d.decompose:
        globals_ = [flat[i] for i in gpos]
        d.boxes = [r != x.sbp for r, x in zip(d.required, globals_)]
        d.ctx = None
        if d.member and d.entry.local is not None:
            d.ctx = LocalContext(placement, d.sigs, d.in_layouts, [o[0] for o in d.out_layouts if o is not None])
    if key is not None:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = d
    return d


def dispatch(func, args, kwargs):
    if func is aten._local_scalar_dense.default:
        return _scalar(args[0])
    try:
        key, globals_, placement = _scan(func, args, kwargs)
    except _Nested:
        return _dispatch_nested(func, args, kwargs)
    d = _decision(func, args, kwargs, key)
    if _explain:
        _explain[-1].append((func, [x.sbp for x in globals_], d))
    if d.decompose:
        return d.entry.decompose(*args, **kwargs)
    locals_ = [
        box(x._local, x._layout, lay) if need else x._local
        for x, need, lay in zip(globals_, d.boxes, d.in_layouts)
    ]
    if not d.member:
        if d.inplace:
            return args[0]
        device = globals_[0]._local.device
        out_flat = [None if o is None else torch.empty(0, dtype=o[0].dtype, device=device) for o in d.out_layouts]
        return _wrap(out_flat, d)
    it = iter(locals_)
    largs = [next(it) if isinstance(a, GlobalTensor) else a for a in args]
    lkwargs = {k: next(it) if isinstance(v, GlobalTensor) else v for k, v in kwargs.items()}
    out = d.entry.local(func, largs, lkwargs, d.ctx) if d.ctx is not None else func(*largs, **lkwargs)
    if d.inplace:
        return args[0]
    if isinstance(out, torch.Tensor):
        lay, stride = d.out_layouts[0]
        return GlobalTensor(out, lay, strides=stride)
    return _wrap(tree_flatten(out)[0], d)


def _wrap(out_flat, d):
    res = [GlobalTensor(o, lay[0], strides=lay[1]) if lay is not None else o for o, lay in zip(out_flat, d.out_layouts)]
    return tree_unflatten(res, d.out_spec)


def _dispatch_nested(func, args, kwargs):
    """Ops whose arguments nest tensors in lists (``cat``, ``index``): the pytree path."""
    flat, spec = tree_flatten((args, kwargs))
    key = [func, len(flat)]
    for a in flat:
        if isinstance(a, GlobalTensor):
            key.extend((a._layout.sbp, a._layout.shape, a._layout.dtype, a._layout.placement))
        elif isinstance(a, torch.Tensor):
            key.append(a.dtype if a.dim() == 0 else ("local", tuple(a.shape)))
        else:
            key.append(_key_part(a))
    key = tuple(key)
    d = _decision(func, args, kwargs, key)
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
        if d.inplace:
            return args[0]
        device = flat[gpos[0]]._local.device
        return _wrap([None if o is None else torch.empty(0, dtype=o[0].dtype, device=device) for o in d.out_layouts], d)
    largs, lkwargs = tree_unflatten(local_flat, spec)
    out = d.entry.local(func, largs, lkwargs, d.ctx) if d.ctx is not None else func(*largs, **lkwargs)
    if d.inplace:
        return args[0]
    return _wrap(tree_flatten(out)[0], d)


def _scalar(x: GlobalTensor):
    """``.item()``: the value needs every axis broadcast."""
    from .sbp import Broadcast

    b = tuple(Broadcast() for _ in x.sbp)
    local = x._local if x.sbp == b else box(x._local, x._layout, x._layout.with_sbp(b))
    if world_rank() not in x.placement:
        raise ValueError(f"rank {world_rank()} is outside {x.placement} and holds no value of this tensor")
    return local.item()


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
