"""``apply_zero``: ZeRO stages 0-3 on any module, from its parallel plan and one cast.

Per parameter there are up to three global tensors (``S(d)``: the master
layout of ``plan.py``, ``B``: the plan's layout, on the data-parallel axis):

- the *master*, fp32, laid out ``S(d)``: the module's registered parameter
  (``module.parameters()``, ``state_dict``, the optimizer and
  ``sc.clip_grad_norm_`` see it);
- the *compute copy*, laid out ``B`` in the compute dtype: what the
  module's forward reads (its attribute, e.g. ``block.attn.c_attn.weight``);
- the *grad leaf*: the tensor autograd accumulates into, in the compute
  dtype (stage 2 moves each micro-batch's gradient, reduced, to a shard
  beside it).

========  =================================  ==================  ===========================
stage     compute copy                       grad leaf           gradient (per step)
========  =================================  ==================  ===========================
0         persistent, ``B`` (master if fp32) the copy            ``P`` kept; ``P -> B`` at sync
1         persistent, ``B``                  the copy            ``P`` kept; ``P -> S(d)`` at sync
2         persistent, ``B``                  the copy            ``P -> S(d)`` per micro-batch,
                                                                 in buckets during backward
3         ``cast_group(unit's leaves, B)``   ``S(d)`` shard      ``P -> S(d)`` in the cast's
          on use, freed after, re-cast for   (master if fp32)    backward, per unit
          backward
========  =================================  ==================  ===========================

Persistent copies are refreshed by ``cast(master, B, dtype)`` (all-gather)
after each optimizer step; in fp32 the master's local *is* the copy's own
rows (a view), so it costs no memory. Stage 3 gathers a *unit* (FSDP's
wrapping: by default each block of a ``ModuleList``, and the rest) when
forward first reads one of its parameters, frees it when the unit's forward
returns, and gathers it again when backward first needs a saved weight of it
(``sbp_core.cast``'s rematerialisation), or when backward recomputes a
forward that reads it (activation checkpointing: one collective for the
unit, its copies kept until the next unit's recompute or the end of
backward). Each gather starts
the next one early, as FSDP's prefetch does: in forward the unit the last
forward that began at the same unit gathered next (the first forward
guesses the modules' order), in
backward the unit whose forward ended before this one's, if backward will
rebuild it (an op saved its weights) or recompute it (a backward
recomputed it before). So the next unit's collective runs while this one
computes, and where each unit runs once per forward, at most two units
are gathered at a time besides the root's (held from its first use to the
end of forward, and in backward from its first saved use to its
backward). A unit's gradients are reduce-scattered in its cast's
backward and land on the grad leaves when the next unit's reduce-scatter
starts, or when backward ends, so each runs while backward computes the
next unit's gradients. So autograd does not accumulate stage 3's
gradients (except a reentrant checkpoint's recomputed reads): hooks on the
grad leaves (the masters in fp32) do not run, and ``torch.autograd.grad``
of the masters is not supported; ``backward()`` returns with ``.grad``
set. Many parameters share one
collective (``cast_many``/``cast_group``), as DDP's and DeepSpeed's buckets
do. Stages 0-2 box the grad leaves' gradients in buckets that overlap
backward (``sbp_core.grad_buckets``: a bucket of about ``bucket_bytes``
starts its collective as soon as backward has accumulated all of it, and
every bucket is waited for when backward ends): stage 2 in every backward,
stages 0-1 in every backward outside ``sc.defer_grad_boxing()`` (with
gradient accumulation, the last micro-batch's). Stage 1 writes its reduced
shard into its own rows of the full gradient's buffer, so it holds what the
paper's stage 1 holds (full-size gradients) until the step.
Communication is never written here: it is boxing between the layouts above.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn

import sbp_core as sc
from sbp_core.cast import Remat, cast, cast_group, cast_many, cast_many_start, remat_saved
from sbp_core.grad_buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradBuckets
from sbp_core.layout import Layout, local_box
from sbp_core.process_groups import world_rank

from .plan import check_stage, describe, rewrite_plan

class _Slot:
    """One parameter (tied ones share a slot): master, grad leaf and compute copy."""

    def __init__(self, zero, master, leaf, compute_sbp):
        self.zero, self.master, self.leaf = zero, master, leaf
        self.compute_sbp = compute_sbp
        self.unit = None  # stage 3: the _Unit gathered with it
        # stage 1: where the reduced shard goes in the full gradient (its own rows), or None
        self.own = _own_slices(leaf.layout, master.sbp, zero.dp_axis) if zero.stage == 1 else None
        self.cache = None  # stage 3: the gathered copy while its unit's forward runs
        self.grad = None  # stages 0-2: the reduced gradient (stage 0: B; 1-2: the S(d) shard), compute dtype

    def compute(self):
        """The tensor forward reads: the persistent copy, or (stage 3) its unit's copies gathered on use."""
        if self.zero.stage < 3:
            return self.leaf
        if self.cache is None:
            if not self.zero._depth:  # read outside the module's forward
                if torch._C._current_graph_task_id() != -1:  # a forward recomputed in backward
                    return self.unit.recomputed(self)
                return cast(self.leaf, self.compute_sbp)  # a one-off copy
            self.unit.gather()
        return self.cache


class _Unit:
    """Stage 3: parameters gathered together (one collective) and freed together, like an FSDP unit."""

    def __init__(self, zero, name: str):
        self.zero, self.name, self.slots = zero, name, []
        self.started = None  # a prefetched gather in flight
        self.remat = None  # this forward's rematerialisation group (backward's gather), once gathered
        self.ahead = None  # (backward's graph task, StartedCast): its gather for a recompute, prefetched
        self.copies = None  # (graph task, compute copies) while backward recomputes a forward that reads it
        self.was_recomputed = False  # a backward recomputed a forward that read it (prefetched from then on)

    def gathered(self) -> bool:
        return self.slots[0].cache is not None

    def prefetch(self) -> None:
        """Start the gather now (it runs while the current unit computes), unless gathered or started."""
        if self.started is None and not self.gathered():
            self.started = cast_many_start([s.leaf for s in self.slots], [s.compute_sbp for s in self.slots])

    def gather(self) -> None:
        started, self.started = self.started, None
        remat = Remat()
        outs = cast_group([s.leaf for s in self.slots], [s.compute_sbp for s in self.slots], remat=remat,
                          started=started, grads_to=self.reducing)
        for s, o in zip(self.slots, outs):
            s.cache = o
        self.remat = remat if remat.xs is not None else None  # None: cast without autograd
        self.zero._gathered(self)

    def recomputed(self, slot):
        """``slot``'s compute copy for a forward that backward recomputes (activation checkpointing): the
        unit gathered once for the recompute (one collective; started early by the recompute of the unit
        after it in forward, where a backward recomputed this one before, unless this backward recomputed
        it already), by a differentiable cast (a
        reentrant checkpoint differentiates the recomputed graph, and its gradient then goes back through
        autograd; a non-reentrant one only takes the recompute's saved tensors)."""
        task = torch._C._current_graph_task_id()
        if self.copies is None or self.copies[0] != task:
            ahead, self.ahead = self.ahead, None
            started = ahead[1] if ahead is not None and ahead[0] == task else None
            if ahead is not None and started is None:
                ahead[1].wait()  # another backward's: let it finish
            outs = cast_group([s.leaf for s in self.slots], [s.compute_sbp for s in self.slots], started=started)
            self.copies = (task, outs)
            self.was_recomputed = True
            self.zero._recomputing(self, task)  # after this unit's gather: the next one's queues behind it
        return self.copies[1][self.slots.index(slot)]

    def drop_recompute(self) -> None:
        self.copies = None
        if self.ahead is not None:
            self.ahead, ahead = None, self.ahead
            ahead[1].wait()

    def reducing(self, started) -> None:
        """Backward started the reduce-scatter of this unit's gradients (``StartedGrads``)."""
        self.zero._reducing(self, started)

    def land(self, started) -> None:
        """Add the reduced gradients to the grad leaves' ``.grad`` (what autograd's accumulation did)."""
        for i, g in started.wait():
            leaf = self.slots[i].leaf
            leaf.grad = _compact(g) if leaf.grad is None else leaf.grad + g

    def free(self, *_) -> None:
        if self.gathered():
            self.zero._ended.append(self)
        if self.remat is not None:
            self.zero._freed.append(self.remat)
            self.remat = None
        if self.started is not None:  # prefetched, not used in this forward
            self.started, started = None, self.started
            started.wait()
        for s in self.slots:
            s.cache = None


def _unit_of(owner: str, units) -> str:
    """The longest unit name that is ``owner`` or encloses it ("" = the root)."""
    best = ""
    for u in units:
        if (owner == u or owner.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _compute_property(name):
    return property(lambda mod: mod._zero_slots[name].compute(), doc=f"compute copy of the master {name!r}")


_classes: dict = {}


def _swap_class(mod: nn.Module, names) -> None:
    """Give ``mod`` a subclass whose ``names`` attributes read compute copies (as ``parametrize`` does)."""
    cls = type(mod)
    key = (cls, frozenset(names))
    if key not in _classes:
        _classes[key] = type(cls.__name__, (cls,), {n: _compute_property(n) for n in names})
    mod.__class__ = _classes[key]


def _nested(msbp: tuple, dp_axis: int) -> bool:
    """Whether the master's dp-axis split dimension is split again on a later mesh axis."""
    d = next((s.axis for i, s in enumerate(msbp) if i == dp_axis and s.is_split), None)
    return d is not None and any(s.is_split and s.axis == d for s in msbp[dp_axis + 1:])


def _own_slices(layout: Layout, msbp: tuple, dp_axis: int):
    """Where this rank's master rows lie in its compute local (index slices), or ``None`` when they
    do not lie inside it (a nested split) or this rank holds no part."""
    p = layout.placement
    me = world_rank()
    if _nested(msbp, dp_axis) or me not in p:
        return None
    outer = local_box(layout.shape, p.shape, layout.sbp, p.coords(me))
    inner = local_box(layout.shape, p.shape, msbp, p.coords(me))
    return tuple(slice(i - o, i - o + n) for (o, _), (i, n) in zip(outer, inner))


def _own_rows(local, layout: Layout, msbp: tuple, dp_axis: int):
    """This rank's master local: a view of the compute local when its rows lie inside it."""
    if _nested(msbp, dp_axis):  # collective on every rank: box from the compute layout
        return sc.GlobalTensor(local, layout).to_global(sbp=msbp)._local
    own = _own_slices(layout, msbp, dp_axis)
    return local if own is None else local[own]


def _same_box(a: Layout, b: Layout) -> bool:
    """Whether this rank's local of layout ``a`` covers the same box of the tensor as of ``b`` (a partial axis
    covers the whole, as ``B`` does)."""
    p, me = a.placement, world_rank()
    return a.placement == b.placement and me in p and \
        local_box(a.shape, p.shape, a.sbp, p.coords(me)) == local_box(b.shape, p.shape, b.sbp, p.coords(me))


def _compact(g):
    """``g``, or a copy when its local is a view that keeps a larger buffer alive (a slice of a ``B``)."""
    local = g._local
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        return sc.GlobalTensor(local.clone(), g.layout)
    return g


class Zero:
    """ZeRO state of one module (one pipeline stage): call ``sync_grads`` before clipping,
    ``refresh`` after each optimizer step (``attach``/``optimizer`` register both as step hooks).
    """

    def __init__(self, module: nn.Module, placement, stage: int, dp_axis: int, compute_dtype, units=None,
                 bucket_bytes: int = BUCKET_BYTES, planned: dict | None = None):
        self.module, self.placement, self.stage, self.dp_axis = module, placement, stage, dp_axis
        self.compute_dtype = compute_dtype
        self._depth = 0
        self._remat = None
        # stage 3: per first unit gathered, the units in the order the last such forward gathered them
        # (a rank's interleaved pipeline stages are forwards of one module that start at different units)
        self._orders: dict = {}
        self._order: list = []  # this forward's: the one its first gather picked
        self._gathers: list = []  # ... and this forward
        self._freed: list = []  # the last forward's remat groups in the order their units were freed
        self._ended: list = []  # ... and its units
        self._before: dict = {}  # unit -> the unit whose forward ended before its own, in the last forward that ran it
        self._recompute = None  # (graph task, unit) backward recomputes a forward of now
        self._recomputed_now: set = set()  # ... and the units it recomputed so far
        self._reducing_now: list = []  # stage 3: (backward's graph task, unit, StartedGrads) in flight
        self._task = None  # the backward (autograd graph task) whose end lands them
        self.slots: list = []
        self._apart: list = []  # slots whose grad leaf is not the master (a compute copy of its own)
        self.units: list = []
        self.buckets = None  # stages 0-2: the grad leaves' GradBuckets
        self._by_leaf: dict = {}
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        # The compute layouts: the plan's (``planned``, as ``sc.planned_sbp`` gives them), which a parameter
        # built straight into its master layout no longer shows.
        self.layouts = {n: (p.shape, (planned or {}).get(n, p.sbp)) for n, p in named.items()}
        # the plan rewrite: B on the dp axis -> S(d) (stage 0 keeps the plan's layouts)
        self.master_plan = {n: sbp for n, (_, sbp) in self.layouts.items()} if stage == 0 else \
            rewrite_plan(self.layouts, dp_axis, placement.shape[dp_axis])
        params = {id(p): p for p in named.values()}
        msbp_of = {id(p): self.master_plan[n] for n, p in named.items()}
        csbp_of = {id(p): self.layouts[n][1] for n, p in named.items()}
        if stage == 0 and all(compute_dtype in (None, p.dtype) for p in params.values()):
            return  # plain data parallel: distribute_module's parameters as they are
        if units is None:  # FSDP's usual wrapping: every block of every ModuleList
            units = [f"{n}.{i}" if n else str(i) for n, m in module.named_modules()
                     if isinstance(m, nn.ModuleList) for i in range(len(m))]
        owners: dict = {}
        for mod_name, mod in module.named_modules():
            for name, p in mod.named_parameters(recurse=False):
                if id(p) in params:
                    owners.setdefault(id(p), []).append((mod_name, mod, name))
        slots: dict = {}  # module -> {name: slot}
        by_unit: dict = {}
        for i, held in owners.items():
            slot = self._slot(params[i], msbp_of[i], csbp_of[i])
            names = {_unit_of(mod_name, units) for mod_name, _, _ in held}
            unit = names.pop() if len(names) == 1 else ""  # tied across units: the root's
            slot.unit = by_unit.setdefault(unit, _Unit(self, unit))
            slot.unit.slots.append(slot)
            for _, mod, name in held:
                mod._parameters[name] = slot.master
                slots.setdefault(mod, {})[name] = slot
        for mod, by_name in slots.items():
            mod._zero_slots = by_name
            _swap_class(mod, by_name)
        self.units = list(by_unit.values())
        if self.units:
            self._orders[self.units[0]] = list(self.units)  # the first forward's guess: the modules' order
        self._apart = [s for s in self.slots if s.leaf is not s.master]
        if stage < 3:
            self.buckets = GradBuckets([s.leaf for s in self.slots], [s.master.sbp for s in self.slots], self._reduced,
                                       bucket_bytes, min(bucket_bytes, FIRST_BUCKET_BYTES), always=stage == 2)
        if stage == 3:
            for unit in self.units:
                if unit.name:
                    module.get_submodule(unit.name).register_forward_hook(unit.free, always_call=True)
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave, always_call=True)

    def describe(self) -> str:
        """One line per parameter: name, shape, compute SBP -> master SBP."""
        return describe(self.layouts, self.master_plan)

    def _slot(self, p, msbp: tuple, csbp: tuple) -> _Slot:
        """``p`` in its compute layout ``csbp``, or (stage 3, built from the meta device) already in its master
        layout ``msbp``."""
        lay = p.layout
        dtype = self.compute_dtype or p.dtype
        built_as_master = tuple(p.sbp) != tuple(csbp)
        own = p._local if built_as_master else _own_rows(p._local, lay, msbp, self.dp_axis)
        if self.stage < 3:
            aliased = dtype == p.dtype and own.untyped_storage().data_ptr() == p._local.untyped_storage().data_ptr()
            master = nn.Parameter(sc.GlobalTensor(own if aliased else own.clone(), lay.with_sbp(msbp)))
            copy = p._local if dtype == p.dtype else p._local.to(dtype)
            leaf = sc.GlobalTensor(copy, Layout(lay.placement, lay.sbp, lay.shape, dtype), requires_grad=True)
        else:
            master = nn.Parameter(sc.GlobalTensor(own if built_as_master else own.clone(), lay.with_sbp(msbp)))
            leaf = master if dtype == p.dtype else sc.GlobalTensor(
                master._local.to(dtype), Layout(lay.placement, msbp, lay.shape, dtype), requires_grad=True)
            leaf.register_post_accumulate_grad_hook(self._compact_grad)
        slot = _Slot(self, master, leaf, tuple(csbp))
        self.slots.append(slot)
        self._by_leaf[id(leaf)] = slot
        return slot

    @staticmethod
    def _compact_grad(leaf) -> None:
        if leaf.grad is not None:
            leaf.grad = _compact(leaf.grad)

    # -- stages 0-2: the buckets' reduced gradients ------------------------------
    def _reduced(self, leaf, g) -> None:
        """``g``: ``leaf.grad`` boxed to the master's layout (a bucket of ``self.buckets`` is done)."""
        s = self._by_leaf[id(leaf)]
        if s.grad is not None:
            s.grad = s.grad + g
        elif s.own is not None and _same_box(leaf.grad.layout, leaf.layout):
            # Into its own rows of the full gradient: stage 1 holds full-size gradients until the step. (A
            # gradient autograd gave in another split, as a sequence-split embedding's may be, holds other rows.)
            s.grad = sc.GlobalTensor(leaf.grad._local[s.own].copy_(g._local), g.layout)
        else:
            s.grad = _compact(g)
        leaf.grad = None

    # -- stage 3: gather on use, prefetch the next, free after ---------------------
    def _enter(self, mod, args) -> None:
        self._depth += 1
        if self._depth == 1:
            self._remat = remat_saved()
            self._remat.__enter__()
            self._gathers, self._freed, self._ended = [], [], []

    def _gathered(self, unit: _Unit) -> None:
        """``unit`` was gathered: start the gather of the unit that came next in the last forward that
        began at the same unit, while this forward follows its order (one unit ahead, as FSDP's forward
        prefetch)."""
        i = len(self._gathers)
        self._gathers.append(unit)
        if i == 0:
            self._order = self._orders.get(unit, [])
        if i + 1 < len(self._order) and self._order[i] is unit:
            self._order[i + 1].prefetch()

    def _reducing(self, unit: _Unit, started) -> None:
        """Backward started ``unit``'s reduce-scatter: land the one started before it (which ran while
        backward computed this unit's gradients) and keep this one in flight, until the next one or the
        end of this backward (FSDP's one reduce-scatter in flight)."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # this backward's first: land the rest when it ends
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._land, task))
        self._land(task)
        self._reducing_now.append((task, unit, started))

    @torch.no_grad()
    def _land(self, task, drop: bool = False) -> None:
        """Wait for ``task``'s reduce-scatters in flight and add their gradients to the grad leaves.
        ``drop``: wait for every other's too and drop them (outside backward, what is left is a raised
        backward's: autograd runs no end-of-backward callback for it); otherwise they stay (a backward
        nested in another, the outer one's)."""
        keep = []
        for entry in self._reducing_now:
            of, unit, started = entry
            if of == task:
                unit.land(started)
            elif drop:
                started.wait()
            else:
                keep.append(entry)
        self._reducing_now = keep

    def _recomputing(self, unit: _Unit, task) -> None:
        """Backward recomputes a forward that reads ``unit`` (activation checkpointing): drop the copies of
        the unit recomputed before it (what the recomputed ops saved of them stays theirs), and start the
        gather of the unit before it in forward, where a backward recomputed that one too."""
        now = self._recompute
        if now is None or now[0] != task:  # this backward's first: drop what is left when it ends
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._recomputed, task))
            self._recomputed_now = set()
        elif now[1] is not unit and now[1].copies is not None and now[1].copies[0] == task:
            now[1].copies = None
        self._recompute = (task, unit)
        self._recomputed_now.add(unit)
        nxt = self._before.get(unit)
        if nxt is not None and nxt.was_recomputed and nxt.ahead is None and nxt not in self._recomputed_now:
            nxt.ahead = (task, cast_many_start([s.leaf for s in nxt.slots], [s.compute_sbp for s in nxt.slots]))

    def _recomputed(self, task) -> None:
        """The end of a backward that recomputed forwards: its gathers, used or not, go."""
        for unit in self.units:
            if unit.ahead is not None and unit.ahead[0] == task or unit.copies is not None and unit.copies[0] == task:
                unit.drop_recompute()
        if self._recompute is not None and self._recompute[0] == task:
            self._recompute = None

    def _leave(self, mod, args, out) -> None:
        self._depth -= 1
        if self._depth == 0:
            for unit in self.units:
                unit.free()
            self._remat.__exit__(None, None, None)
            self._remat = None
            # Backward needs the units' weights in the reverse of the order their forwards ended
            # (FSDP's reverse post-forward order): each group's rebuild starts the next one's.
            for later, earlier in zip(self._freed[1:], self._freed):
                later.then = earlier
            for unit in self._ended:  # what an earlier forward that ran a unit said of it goes
                self._before.pop(unit, None)
            self._before.update(zip(self._ended[1:], self._ended))  # per chunk: interleaved stages' too
            if self._gathers:
                self._orders[self._gathers[0]] = self._gathers
            self._order, self._gathers = [], []

    # -- the optimizer step ----------------------------------------------------
    def parameters(self):
        """The masters (what the optimizer steps); the same as ``module.parameters()``."""
        return self.module.parameters()

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Give every master its gradient in the master layout and dtype; idempotent.

        Stage 0: ``P -> B`` (all-reduce); stage 1: ``P -> S(d)`` (reduce-scatter),
        once per step however many micro-batches accumulated, one collective for
        all, unless backward's buckets already did it (then only converted to the
        master's dtype); stages 2-3: already ``S(d)``, converted to the master's dtype.
        Frees the compute-dtype gradients.
        """
        if not self.slots:
            sc.box_grads(self.module)
            return
        self._leftovers()
        todo, done = [], []  # to box or convert; already in the master's layout and dtype (the buckets')
        for s in self._apart:
            g = s.grad if s.grad is not None else s.leaf.grad
            if g is not None:
                (done if g.layout is s.master.layout else todo).append((s, g))
        for dtype in {s.master.dtype for s, _ in todo}:
            group = [(s, g) for s, g in todo if s.master.dtype == dtype]
            done += zip([s for s, _ in group], cast_many([g for _, g in group], [s.master.sbp for s, _ in group], dtype))
        for s, g in done:
            g = _compact(g)
            s.master.grad = g if s.master.grad is None else s.master.grad + g
        self._drop_compute_grads()

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast the compute copies from the updated masters (stages 0-2: one all-gather; 3: local)."""
        todo = self._apart
        cast_many([s.master for s in todo], [s.leaf.sbp for s in todo], self.compute_dtype,
                  into=[s.leaf._local for s in todo])

    def zero_grad(self) -> None:
        """Drop every gradient this state holds (stages 1-3, or 0 with a compute dtype): the masters'
        (an optimizer over their shards clears only the shards'), the compute-dtype ones not yet synced,
        and what a backward that raised left in flight or in the gradient buckets. After a skipped step,
        or a backward that raised, before the next."""
        self._leftovers()
        self._drop_compute_grads()
        for s in self.slots:
            s.master.grad = None
        if self.buckets is not None:
            self.buckets.reset()

    def _leftovers(self) -> None:
        """Stage 3, outside backward: what a backward that raised left (autograd runs no end-of-backward
        callback for it): reductions in flight, dropped; gathers for recomputed forwards."""
        self._land(None, drop=True)
        for unit in self.units:
            unit.drop_recompute()
        self._recompute = None

    def _drop_compute_grads(self) -> None:
        for s in self._apart:
            s.leaf.grad = None
        for s in self.slots:
            s.grad = None

    def attach(self, optimizer: torch.optim.Optimizer, shards=()) -> torch.optim.Optimizer:
        """Run ``sync_grads`` before and ``refresh`` after every ``optimizer.step()``.

        ``shards``: ``(master, local)`` pairs when the optimizer steps the masters'
        local tensors (``optimizer(..., shards=True)``): before the step each
        local gets its master's (synced, clipped) gradient, after it both drop it.
        """
        shards = list(shards)

        def pre(opt, args, kwargs):
            self.sync_grads()
            for master, local in shards:
                local.grad = None if master.grad is None else master.grad._local

        def post(opt, args, kwargs):
            self.refresh()
            for master, local in shards:
                master.grad = local.grad = None

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        return optimizer

    def optimizer(self, cls, params=None, shards: bool = True, **kwargs) -> torch.optim.Optimizer:
        """``cls(params, **kwargs)`` over the masters (default all; a list of masters or of
        param-group dicts), attached.

        ``shards=True`` hands the optimizer each master's local tensor instead: an
        element-wise optimizer (SGD, Adam, AdamW, ...) computes the same update on
        the shard without the global-tensor dispatch per op; its state is local.
        ``shards=False`` keeps global tensors (global state, any optimizer).
        """
        params = list(self.parameters()) if params is None else list(params)
        if not shards:
            return self.attach(cls(params, **kwargs))
        pairs = self.shard_pairs()
        local_of = {id(m): local for m, local in pairs}

        def to_local(ps):
            return [local_of[id(p)] for p in ps]

        groups = [dict(g, params=to_local(g["params"])) for g in params] if params and isinstance(params[0], dict) \
            else to_local(params)
        return self.attach(cls(groups, **kwargs), pairs)

    def shard_pairs(self) -> list:
        """``(master, its local tensor)`` for every master: what an optimizer over shards steps."""
        return [(m, m._local) for m in self.parameters()]


_APPLIED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules apply_zero rewrote (it refuses a second time)


def apply_zero(module: nn.Module, placement, plan: dict | None = None, stage: int = 1, dp_axis: int = 0,
               compute_dtype: torch.dtype | None = None, units: list | None = None,
               bucket_bytes: int = BUCKET_BYTES):
    """Distribute ``module`` by ``plan`` on ``placement`` with ZeRO ``stage`` on mesh axis ``dp_axis``.

    Returns ``(module, zero)``; ``module`` is changed in place (its parameters
    become fp32 masters, its forward reads compute copies in
    ``compute_dtype``, default the parameters' dtype). Every rank calls it
    with the same module (same seed). Stage 1-3 with a data-parallel size of
    1 warns and runs stage 0; an unknown stage raises ``ValueError``.
    ``units`` (stage 3): names of submodules whose parameters are gathered
    with one collective and freed when the submodule's forward returns;
    default every block of every ``nn.ModuleList``; the rest (and parameters
    shared across units) form the root's unit, freed when the root returns.
    ``bucket_bytes`` (stages 0-2): gradient bytes per collective overlapping backward.
    """
    if not 0 <= dp_axis < placement.ndim:
        raise ValueError(f"dp_axis {dp_axis} is not a mesh axis of {placement} (valid: 0..{placement.ndim - 1})")
    if compute_dtype is not None and not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype {compute_dtype} is not a floating dtype (e.g. torch.bfloat16)")
    if module in _APPLIED:
        raise ValueError(f"{type(module).__name__} already has ZeRO applied")
    stage = check_stage(stage, placement.shape[dp_axis])
    planned = sc.planned_sbp(module, placement, plan)
    if stage == 3:
        # A parameter on the meta device is built straight into its master layout: each rank builds (reads,
        # draws) only its slice on the dp axis, never the whole compute layout of every parameter at once.
        shapes = {n: p.shape for n, p in module.named_parameters() if p.is_meta and p.requires_grad}
        masters = rewrite_plan({n: (shapes[n], planned[n]) for n in shapes}, dp_axis, placement.shape[dp_axis])
        # exact names first, so that they win (a key of both keeps the first place, so the plan's go after)
        plan = {**masters, **{k: v for k, v in (plan or {}).items() if k not in masters}}
    sc.distribute_module(module, placement, plan, bucket_bytes)
    zero = Zero(module, placement, stage, dp_axis, compute_dtype, units, bucket_bytes, planned)
    _APPLIED.add(module)
    return module, zero
