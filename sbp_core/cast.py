"""``cast``: a differentiable change of layout and dtype, coalesced over many tensors, rematerialisable.

``cast(x, sbp, dtype)`` is the op ZeRO is written with: a master laid out
``S(d)`` on the data-parallel mesh axis cast to a compute copy that is
``B`` there (optionally bf16). Its SBP signature is the boxing's,
``x.sbp -> sbp``, and its gradient is the boxing's gradient (see
``boxing.autograd``): arriving ``P`` on an axis where ``x`` is ``S(d)``, it
is reduce-scattered to ``S(d)``; then converted back to ``x``'s dtype. The
dtype changes where the tensor is smaller: a narrowing cast (fp32 -> bf16)
converts the shard before the all-gather and the backward reduce-scatters
in bf16; a widening one boxes first.

``cast_group(xs, sbps, dtype)`` is the same for many tensors at once, with
one collective per kind of step (``boxing.coalesced``) in forward and in
backward: what FSDP's flat parameters and DDP's buckets buy, as a layout
change of a list. ``cast_many`` is its no-autograd form.

Rematerialisation: inside ``remat_saved()``, the outputs of a cast made with
``remat=True`` are not kept alive by autograd. An op that saves one, or a
view of one, for backward (a matmul saves its weight) saves a small handle
instead; unpacking it in backward casts again without autograd (a group
casts all its members once and keeps them until the group's backward has
run). So gathered tensors live only while forward uses them and while
backward needs them: ZeRO-3's gather on use, free after, gather again.

Prefetch: ``cast_many_start`` starts a cast's collectives and returns at
once, and ``cast_group(..., started=...)`` takes its result as the
forward's; a ``Remat`` group linked to the next group backward rebuilds
(``then``) starts that rebuild when it is itself rebuilt. So the next
gather runs while the current group's compute does (on NCCL its own
stream; on gloo the backend's threads), as FSDP's prefetch does.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .global_tensor import GlobalTensor
from .layout import Layout
from .sbp import nd_sbp


def _narrowing(x, dtype) -> bool:
    return dtype is not None and dtype.itemsize < x.element_size()


class _Convert(torch.autograd.Function):
    """Dtype change of the locals in any layout; the gradient changes back. (What ``x.to(dtype)``
    does, without deciding ``_to_copy``'s signature per call.)"""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return GlobalTensor(x._local.to(dtype), Layout(x.placement, x.sbp, x.shape, dtype))

    @staticmethod
    def backward(ctx, g):
        return GlobalTensor(g._local.to(ctx.dtype), Layout(g.placement, g.sbp, g.shape, ctx.dtype)), None


def _convert(x: GlobalTensor, dtype) -> GlobalTensor:
    if dtype is None or x.dtype == dtype:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _Convert.apply(x, dtype)
    return GlobalTensor(x._local.to(dtype), Layout(x.placement, x.sbp, x.shape, dtype))


def _box(x: GlobalTensor, placement, sbp) -> GlobalTensor:
    return x if placement == x.placement and sbp == x.sbp else x.to_global(placement=placement, sbp=sbp)


def _check(x, dtype) -> None:
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"cast takes global tensors, got {type(x).__name__}")
    if dtype is not None and not dtype.is_floating_point and x.is_floating_point():
        raise ValueError(f"cast to {dtype} would truncate a {x.dtype} tensor; cast between floating dtypes")


def cast(x: GlobalTensor, sbp=None, dtype: torch.dtype | None = None, placement=None,
         remat: bool = False) -> GlobalTensor:
    """``x`` laid out as ``sbp`` on ``placement`` (defaults: x's) in ``dtype`` (default: x's).

    Differentiable; communicates what boxing ``x.sbp -> sbp`` communicates,
    in the smaller of the two dtypes. With ``remat=True`` the output is
    rematerialised for backward inside ``remat_saved()`` (module docstring).
    """
    _check(x, dtype)
    placement = x.placement if placement is None else placement
    sbp = x.sbp if sbp is None else nd_sbp(sbp, placement.ndim)
    if _narrowing(x, dtype):
        out = _box(_convert(x, dtype), placement, sbp)
    else:
        out = _convert(_box(x, placement, sbp), dtype)
    if remat and out is not x and out.requires_grad and out._local.numel():
        _register(out, _Single(x, x._version, placement, sbp, dtype))
    return out


class StartedCast:
    """``cast_many``'s collectives in flight (``cast_many_start``): ``wait()`` gives the casts."""

    def __init__(self, pending, dsts, tensors, dtype, into, widening):
        self._pending, self._dsts, self._tensors = pending, dsts, tensors
        self._dtype, self._into, self._widening = dtype, into, widening

    @torch.no_grad()
    def wait(self) -> list:
        dtype = self._dtype
        outs = [GlobalTensor(loc, dst) for loc, dst in zip(self._pending.wait(), self._dsts)]
        outs = [o if _narrowing(t, dtype) else _convert(o, dtype) for o, t in zip(outs, self._tensors)]
        if self._into is not None:
            for o, t, w in zip(outs, self._into, self._widening):
                if w:
                    t.copy_(o._local)
        return outs


@torch.no_grad()
def cast_many_start(tensors, sbps, dtype: torch.dtype | None = None, into=None) -> StartedCast:
    """Start ``cast_many``: its collectives run while the caller goes on (a prefetch); ``wait()`` on
    the result gives what ``cast_many`` returns. Every rank of the world starts and waits its casts
    in one order. The tensors may change once this returns (the collectives read packed copies)."""
    from .boxing.coalesced import box_many_async

    tensors = list(tensors)
    for t in tensors:
        _check(t, dtype)
    xs = [_convert(t, dtype) if _narrowing(t, dtype) else t for t in tensors]
    dsts = [Layout(x.placement, nd_sbp(s, x.placement.ndim), x.shape, x.dtype) for x, s in zip(xs, sbps)]
    widening = [not _narrowing(t, dtype) and dtype not in (None, t.dtype) for t in tensors]
    direct = None if into is None else [None if w else o for o, w in zip(into, widening)]
    pending = box_many_async([(x._local, x.layout, dst) for x, dst in zip(xs, dsts)], direct)
    return StartedCast(pending, dsts, tensors, dtype, into, widening)


def cast_many(tensors, sbps, dtype: torch.dtype | None = None, into=None) -> list:
    """``[cast(t, s, dtype) for ...]`` without autograd; one collective per kind of step and axis.

    ``into`` (optional): one local tensor per result, of its local shape and
    dtype, that receives it (ZeRO's refresh writes the gathered copies into
    the compute copies' storage without an intermediate tensor)."""
    return cast_many_start(tensors, sbps, dtype, into).wait()


class StartedGrads:
    """A ``cast_group``'s input gradients being boxed back (``grads_to``): ``wait()`` gives
    ``[(input index, gradient)]``, each gradient in its input's placement, shape and dtype."""

    def __init__(self, pending, todo: list, dsts: list):
        self._pending, self._todo, self._dsts = pending, todo, dsts

    @torch.no_grad()
    def wait(self) -> list:
        return [(i, GlobalTensor(local.to(dst.dtype), dst))
                for i, local, dst in zip(self._todo, self._pending.wait(), self._dsts)]


class _CastGroup(torch.autograd.Function):
    """``cast_many`` with a gradient: each input's gradient boxed back to its layout, coalesced."""

    @staticmethod
    def forward(ctx, sbps, dtype, group, started, grads_to, *xs):
        ctx.layouts = [x.layout for x in xs]
        ctx.group, ctx.grads_to = group, grads_to
        ctx.set_materialize_grads(False)
        return tuple(cast_many(xs, sbps, dtype) if started is None else started.wait())

    @staticmethod
    def backward(ctx, *grads):
        from .boxing.autograd import grad_sbp
        from .boxing.coalesced import box_many_async

        if ctx.group is not None:
            ctx.group.release()
        todo = [i for i, g in enumerate(grads) if g is not None]
        items, dsts = [], []
        for i in todo:
            src, g = ctx.layouts[i], grads[i]
            if any(s.is_partial and s.op != "sum" for s in src.sbp):
                raise ValueError(f"cast_group's gradient through {src.sbp} (a partial max/min) is not defined")
            sbp = grad_sbp(src, g.layout)
            items.append((g._local, g.layout, Layout(src.placement, sbp, src.shape, g.dtype)))
            dsts.append(Layout(src.placement, sbp, src.shape, src.dtype))
        started = StartedGrads(box_many_async(items), todo, dsts)
        out = [None] * len(grads)
        if ctx.grads_to is not None:
            ctx.grads_to(started)
        else:
            for i, g in started.wait():
                out[i] = g
        return (None, None, None, None, None) + tuple(out)


def cast_group(xs, sbps, dtype: torch.dtype | None = None, remat=False, started: "StartedCast | None" = None,
               grads_to=None) -> list:
    """``[cast(x, s, dtype) for ...]`` as one differentiable op: one collective per kind of step
    in forward and in backward.

    ``remat``: ``True`` or a fresh ``Remat`` (which then names the group):
    the outputs are rematerialised as one group (module docstring).
    ``started``: ``cast_many_start(xs, sbps, dtype)``, begun earlier (a
    prefetch); its result is the forward's, so this cast communicates
    nothing more in forward.
    ``grads_to``: backward starts boxing the inputs' gradients and hands the
    ``StartedGrads`` to ``grads_to`` instead of returning them to autograd
    (the inputs get no ``.grad``, and their hooks see nothing, from this
    op; ``torch.autograd.grad`` of them gets none): the caller waits when
    it needs them, so the collective runs while backward goes on (ZeRO-3's
    reduce-scatter). Every rank waits its casts' gradients in one order.
    """
    xs = list(xs)
    sbps = [nd_sbp(s, x.placement.ndim) for x, s in zip(xs, sbps)]
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in xs):
        return cast_many(xs, sbps, dtype) if started is None else started.wait()
    group = None
    if remat:
        group = Remat() if remat is True else remat
        group._bind(xs, sbps, dtype)
    outs = list(_CastGroup.apply(sbps, dtype, group, started, grads_to, *xs))
    if group is not None:
        for i, o in enumerate(outs):
            if o._local.numel():
                _register(o, _Member(group, i))
    return outs


# -- rematerialisation ---------------------------------------------------------------

def _check_version(x, version) -> None:
    if x._version != version:
        raise RuntimeError(
            "a tensor a rematerialised cast was made from was modified in place between forward and "
            f"backward (version {version} -> {x._version}); step the optimizer after backward"
        )


@dataclass
class _Single:
    """Rebuilds ``cast(x, sbp, dtype, placement)`` while ``x`` is unchanged."""

    x: GlobalTensor
    version: int
    placement: object
    sbp: tuple
    dtype: object

    def rebuild(self) -> torch.Tensor:
        _check_version(self.x, self.version)
        with torch.no_grad():
            return cast(self.x, self.sbp, self.dtype, self.placement)._local


class Remat:
    """A ``cast_group``'s outputs rebuilt in backward together, once, and kept until the group's
    backward has run (``release``).

    ``saved``: an op saved one of its outputs (a handle), so backward
    rebuilds it when it unpacks that. ``then``: the group rebuilt next in
    backward, as the caller expects (ZeRO-3: the unit whose forward ended
    before); when this group is rebuilt, ``then``'s rebuild starts
    (``prefetch``) if ``then`` saved outputs too, so that its collectives
    run while backward uses this one. Every rank links its groups alike
    (the ranks of one collective hold members of the same shapes, so they
    save alike).
    """

    def __init__(self):
        self.xs = None
        self.cache = None
        self.started = None  # a prefetched rebuild in flight
        self.then = None
        self.saved = False
        self.released = False  # its backward ran: never prefetched again

    def _bind(self, xs, sbps, dtype) -> None:
        if self.xs is not None:
            raise ValueError("a Remat names one cast_group; make a new one per call")
        self.xs, self.sbps, self.dtype = xs, sbps, dtype
        self.versions = [x._version for x in xs]

    def prefetch(self) -> None:
        """Start rebuilding, unless built or started already, released, or never cast."""
        if self.xs is not None and not self.released and self.cache is None and self.started is None:
            self._start()

    def _start(self) -> None:
        for x, v in zip(self.xs, self.versions):
            _check_version(x, v)
        self.started = cast_many_start(self.xs, self.sbps, self.dtype)

    def local(self, i: int) -> torch.Tensor:
        if self.cache is None:
            if self.started is None:
                self._start()
            started, self.started = self.started, None
            self.cache = [o._local for o in started.wait()]
            if self.then is not None and self.then.saved:
                self.then.prefetch()
        return self.cache[i]

    def release(self) -> None:
        self.cache = None
        self.released = True
        if self.started is not None:  # prefetched, never used: let its collectives finish
            self.started, started = None, self.started
            started.wait()


@dataclass
class _Member:
    group: Remat
    index: int

    def rebuild(self) -> torch.Tensor:
        return self.group.local(self.index)


@dataclass
class _Handle:
    """What autograd saves in place of a cast output or a view of it."""

    source: object
    layout: Layout
    strides: tuple
    size: tuple
    stride: tuple
    offset: int  # storage offset relative to the cast output's local


# storage address of a live remat cast output's local -> (weak ref to the output, its source)
_live: dict = {}


def _register(out: GlobalTensor, source) -> None:
    key = out._local.untyped_storage().data_ptr()

    def forget(ref, key=key):
        entry = _live.get(key)
        if entry is not None and entry[0] is ref:
            del _live[key]

    _live[key] = (weakref.ref(out, forget), source)


def _pack(t):
    if not isinstance(t, GlobalTensor) or not t._local.numel():
        return t
    entry = _live.get(t._local.untyped_storage().data_ptr())
    base = None if entry is None else entry[0]()
    if base is None:
        return t
    local = t._local
    if isinstance(entry[1], _Member):
        entry[1].group.saved = True
    return _Handle(entry[1], t.layout, t.stride(), tuple(local.shape), local.stride(),
                   local.storage_offset() - base._local.storage_offset())


def _unpack(h):
    if not isinstance(h, _Handle):
        return h
    base = h.source.rebuild()
    local = base.as_strided(h.size, h.stride, base.storage_offset() + h.offset)
    return GlobalTensor(local, h.layout, strides=h.strides)


def remat_saved():
    """Context manager: autograd saves handles, not copies, of outputs of casts made with ``remat=True``."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
