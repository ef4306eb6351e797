"""Deciding how an op runs on global tensors: the dispatcher's slow path, once per cache key.

For an op and its inputs' layouts the op's rule proposes 1-d signatures per
mesh axis; their N-d products are costed by the boxing planner's bytes
(docs/design.md's table) and the cheapest wins, ties going to the one that
changes fewest inputs. Output shapes and strides come from running the op
once on meta tensors. Everything the hot path needs is precomputed into the
``Decision``: which inputs to box, the output layouts and how to wrap them,
and whether the op can run as plain ``func(*locals)`` (``plain``).
"""
from __future__ import annotations

import itertools
import math

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .boxing.nd_plan import plan
from .global_tensor import GlobalTensor, NoSbpRule
from .layout import Layout, local_shape
from .local_call import local_callable
from .ops.registry import Call, Sig, TensorMeta, lookup
from .process_groups import world_rank
from .sbp import Broadcast, format_sbp
from .torch_compat import is_inplace

_B = Broadcast()

# How the hot path wraps an op's output (``Decision.wrap``).
WRAP_ONE, WRAP_SEQ, WRAP_TREE = 0, 1, 2


class LocalContext:
    """What a custom local implementation may need: where this rank sits and the chosen signature.

    ``local_out_shapes``: this rank's local shape of each tensor output
    (computed once per decision, so ``sized_local`` ops pay no geometry per call).
    """

    __slots__ = ("placement", "coords", "sigs", "in_layouts", "out_layouts", "local_out_shapes")

    def __init__(self, placement, sigs, in_layouts, out_layouts):
        self.placement = placement
        self.coords = placement.coords(world_rank())
        self.sigs = sigs  # one 1-d Sig per mesh axis
        self.in_layouts = in_layouts  # boxed layouts of the global inputs
        self.out_layouts = out_layouts
        self.local_out_shapes = [tuple(local_shape(o.shape, placement.shape, o.sbp, self.coords)) for o in out_layouts]


class Decision:
    """How one (op, input layouts, arguments) runs on this rank; built once, read on every call.

    - ``required``/``in_layouts``: the inputs' chosen SBP and layouts; ``boxes[j]``: input ``j`` needs boxing;
    - ``out_layouts``: per flattened output, ``(Layout, global strides)`` or ``None`` (not a tensor);
    - ``plain``: member rank, no boxing, no custom local, no global tensor in kwargs: run ``func(*locals)``;
    - ``direct_local``: the same but with a custom local: run ``entry.local(func, locals, kwargs, ctx)``;
    - ``call``: what runs the op on locals (``local_call.local_callable``: its Python binding or ``func._op``);
    - ``wrap``: ``WRAP_ONE`` (a tensor), ``WRAP_SEQ`` (a flat tuple/list, type ``seq_type``) or ``WRAP_TREE``;
    - ``fast``: ``one`` plus the output local's device when the op is ``plain``, not in place, has one
      tensor output and names no device (the hot path's single test), else ``None``;
    - ``func`` is kept so the op object (whose ``id`` keys the cache) outlives the entry.
    """

    __slots__ = ("func", "required", "out_layouts", "out_spec", "entry", "sigs", "decompose", "inplace", "cost",
                 "in_layouts", "member", "boxes", "ctx", "plain", "wrap", "seq_type", "one", "kw_globals", "call", "meta_out", "many",
                 "direct_local", "fast")


def _describe(flat):
    return [f"{tuple(a.shape)} {format_sbp(a.sbp)}" if isinstance(a, GlobalTensor) else type(a).__name__ for a in flat if isinstance(a, torch.Tensor)]


def _plan_cost(src, dst, placement, shape, dtype) -> float:
    if src == dst:
        return 0.0
    try:
        return plan(src, dst, placement.shape, tuple(shape), dtype.itemsize)[1]
    except ValueError:
        return math.inf


def mixed_placements(func, p1, p2):
    raise ValueError(
        f"{func} mixes global tensors on {p1} and {p2}: box one of them with .to_global(placement=...) first"
    )


def mixed_local(func, a):
    raise ValueError(
        f"{func} mixes a global tensor with a local {tuple(a.shape)} tensor: "
        "declare it with sc.to_global(local, placement, sbp) first"
    )


def _meta_args(flat, spec, gpos):
    """The call's ``(args, kwargs)`` with fresh meta tensors (global shape and strides) for the globals."""
    meta_flat = list(flat)
    for i in gpos:
        x = flat[i]
        meta_flat[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    margs, mkwargs = tree_unflatten(meta_flat, spec)
    if isinstance(mkwargs.get("device"), torch.device):  # e.g. autocast's _to_copy(..., device=cpu)
        mkwargs = {**mkwargs, "device": torch.device("meta")}
    return margs, mkwargs


def _natural_outputs(entry, call, actual) -> "tuple | None":
    """Output SBPs the rule gives, on the one-device axis ``call.axis``, for the inputs as they are.

    There every SBP is the whole tensor, so these are only labels, and the op
    runs its plain signature; but they keep what the layout says on that axis
    (``S(0)`` data stays ``S(0)`` on a dp axis of one device), which a
    rehearsal's logical graph reports and extrapolates to more devices.
    """
    seen, call.sbps = call.sbps, actual
    try:
        for g in entry.rule(call):
            if all(i is None or i == a[call.axis] for i, a in zip(g.inputs, actual)):
                return g.outputs
    except Exception:  # noqa: BLE001 - a rule refusing these labels: the plain signature's B
        return None
    finally:
        call.sbps = seen
    return None


def _signatures_per_axis(entry, call, placement, actual) -> list:
    """The rule's signatures on each mesh axis; on an axis of one device, the op's plain signature alone."""
    per_axis = []
    for axis, n in enumerate(placement.shape):
        call.p, call.axis = n, axis
        sigs = entry.rule(call)
        if n == 1:
            plain = [Sig((None,) * len(g.inputs), g.outputs) for g in sigs
                     if all(i is None or i.is_broadcast for i in g.inputs) and all(o.is_broadcast for o in g.outputs)]
            if plain:
                sigs = [Sig(plain[0].inputs, _natural_outputs(entry, call, actual) or plain[0].outputs)]
        per_axis.append(sigs)
    return per_axis


def _starves(sbp, actual, shape, mesh_shape) -> bool:
    """Whether boxing to ``sbp`` (from ``actual``) splits a dim into more parts than it has rows, leaving some
    rank nothing to compute (a batch of one split over a context-parallel axis)."""
    if sbp == actual:
        return False
    parts: dict = {}
    for s, n in zip(sbp, mesh_shape):
        if s.is_split:
            parts[s.axis] = parts.get(s.axis, 1) * n
    return any(d < len(shape) and shape[d] < k for d, k in parts.items())


def _cheapest(per_axis, actual, metas, placement, inplace: bool):
    """``((impossible, starves, cost, inputs changed), signatures, required input SBPs)`` of the cheapest combination of one
    signature per axis (the boxing cost of its inputs), or ``None`` when none applies (in place: the
    first input must keep its layout). A combination that boxes an input to a split leaving some rank empty
    (``_starves``) comes after every one that does not: bytes alone would count one rank doing all the work
    as cheap."""
    best = None
    for sigs in itertools.product(*per_axis):
        required = [
            tuple(a if s.inputs[j] is None else s.inputs[j] for a, s in zip(actual[j], sigs)) for j in range(len(actual))
        ]
        if inplace and required[0] != actual[0]:
            continue
        cost = sum(_plan_cost(actual[j], required[j], placement, metas[j].shape, metas[j].dtype) for j in range(len(actual)))
        # Ties (free boxings such as B -> S) go to the signature that changes fewest inputs.
        starves = any(_starves(required[j], actual[j], metas[j].shape, placement.shape) for j in range(len(actual)))
        rank = (math.isinf(cost), starves, cost, sum(r != a for r, a in zip(required, actual)))
        if best is None or rank < best[0]:
            best = (rank, sigs, required)
    return best


def _choose(func, flat, spec, gpos, placement) -> Decision:
    entry = lookup(func)
    globals_ = [flat[i] for i in gpos]
    if entry is None:
        raise NoSbpRule(
            f"no SBP rule for {func} with inputs {_describe(flat)}: add one in sbp_core/ops, "
            "or box the inputs and run the op on their locals"
        )
    metas = [TensorMeta(x.shape, x.dtype) for x in globals_]
    rule_flat = list(flat)
    for i, x in zip(gpos, globals_):
        rule_flat[i] = TensorMeta(x.shape, x.dtype)
    margs, mkwargs = _meta_args(flat, spec, gpos)
    out = func(*margs, **mkwargs)
    out_flat, out_spec = tree_flatten(out)
    rargs, rkwargs = tree_unflatten(rule_flat, spec)
    actual = [x.sbp for x in globals_]
    d = Decision()
    d.func = func
    d.entry = entry
    d.inplace = is_inplace(func)
    d.out_spec = out_spec
    d.meta_out = out
    d.plain = d.direct_local = False
    d.fast = None
    # On a mesh axis of one device every SBP is the whole tensor: rules see B there and get
    # the op's plain signature (no model-parallel loss or masked lookup for nothing), and
    # inputs keep their layout on that axis (no boxing).
    single = [n == 1 for n in placement.shape]
    seen = [tuple(_B if one else x for one, x in zip(single, a)) for a in actual] if any(single) else actual
    call = Call(func, rargs, rkwargs, metas, 1, 0, placement.shape, seen)
    if entry.decompose_when is not None and entry.decompose_when(call):
        d.decompose = True
        return d
    d.decompose = False
    per_axis = _signatures_per_axis(entry, call, placement, actual)
    best = _cheapest(per_axis, actual, metas, placement, d.inplace)
    if best is None or best[0][0]:
        valid = [" x ".join(f"{[format_sbp((i,)) for i in s.inputs]}->{[format_sbp((o,)) for o in s.outputs]}" for s in sigs) for sigs in itertools.product(*per_axis)]
        raise ValueError(
            f"{func} cannot run with inputs {_describe(flat)}"
            + (" in place" if d.inplace else "")
            + f"; valid signatures per mesh axis: {valid[:12]}"
        )
    (_, _, d.cost, _), d.sigs, d.required = best
    d.in_layouts = [x.layout.with_sbp(r) for x, r in zip(globals_, d.required)]
    d.out_layouts = []
    k = 0
    for o in out_flat:
        if isinstance(o, torch.Tensor):
            sbp = tuple(s.outputs[k] for s in d.sigs)
            d.out_layouts.append((Layout(placement, sbp, o.shape, o.dtype), o.stride()))
            k += 1
        else:
            d.out_layouts.append(None)
    assert k == sum(isinstance(o, torch.Tensor) for o in out_flat)
    return d


def _wrap_kind(d: Decision, device) -> None:
    """How the hot path rebuilds the output: one tensor, a flat tuple/list, or the pytree.

    ``device`` is where the output's local lives (the inputs' locals' device, on the placement's
    device type) when the call names no device, else None: only then does ``fast`` carry it,
    so the hot path reads no ``out.device`` (a device object built per op, ~70 ns).
    """
    spec = d.out_spec
    # What the hot path wraps each output with: (shape, strides, dtype, layout), None for a non-tensor.
    # Dense row-major strides go as None: the wrapper constructor then derives them itself, which
    # costs less than parsing a strides tuple (~0.15 us an op).
    d.many = [None if o is None else (o[0].shape, None if o[1] == o[0].strides else o[1], o[0].dtype, o[0])
              for o in d.out_layouts]
    d.one = d.many[0] if spec.is_leaf() else None
    d.fast = None
    if d.plain and not d.inplace and d.one is not None and device is not None:
        d.fast = d.one + (device,)
    d.seq_type = None
    if d.one is not None:
        d.wrap = WRAP_ONE
    elif spec.type in (tuple, list) and all(c.is_leaf() for c in spec.children()):
        d.wrap, d.seq_type = WRAP_SEQ, spec.type
    else:
        d.wrap = WRAP_TREE


def decide(func, args, kwargs) -> Decision:
    """Validate the call (one placement, no local tensors but scalars) and choose how it runs."""
    flat, spec = tree_flatten((args, kwargs))
    gpos = [i for i, a in enumerate(flat) if isinstance(a, GlobalTensor)]
    placement = flat[gpos[0]].placement
    for a in flat:
        if isinstance(a, GlobalTensor) and a.placement != placement:
            mixed_placements(func, placement, a.placement)
        elif isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() != 0:
            mixed_local(func, a)
    d = _choose(func, flat, spec, gpos, placement)
    d.member = world_rank() in placement
    if d.decompose:
        return d
    globals_ = [flat[i] for i in gpos]
    d.boxes = [r != x.sbp for r, x in zip(d.required, globals_)]
    d.ctx = None
    if d.member and d.entry.local is not None:
        d.ctx = LocalContext(placement, d.sigs, d.in_layouts, [o[0] for o in d.out_layouts if o is not None])
    d.kw_globals = any(isinstance(v, GlobalTensor) for v in kwargs.values())
    d.plain = d.member and d.ctx is None and not any(d.boxes) and not d.kw_globals
    d.direct_local = d.member and d.ctx is not None and not any(d.boxes) and not d.kw_globals
    d.call = func._op
    if d.member and d.ctx is None:
        margs, mkwargs = _meta_args(flat, spec, gpos)
        d.call = local_callable(func, margs, mkwargs, d.meta_out)
    d.meta_out = None
    device = flat[gpos[0]]._local.device
    if device.type != placement.device_type or any(isinstance(a, torch.device) for a in flat):
        device = None  # a call naming a device, or locals off the placement's device: read out.device
    _wrap_kind(d, device)
    return d
