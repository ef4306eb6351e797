"""One pipeline stage's training step, rehearsed: what each of its phases costs one rank.

A step of stage ``s`` runs, on each of its ranks (as ``runtime.pipeline``
does): per micro-batch a forward (``F``) and a backward (``B``; gradients
accumulate in the layout they arrive in), then once per step the gradient
reduction (``reduce``: each gradient boxed to its parameter's layout, or
ZeRO's own sync) and the update (``update``: global-norm clipping over the
stage, the optimizer step by ``sc.step_on_locals``). ``trace_stage`` runs
exactly that on fake tensors (``rehearsal.Rehearsal``) for two micro-batches — the second
backward also adds into existing gradients — and returns a
``StageTrace``: the events of ``F``, ``B0`` (first backward), ``B`` (later
ones), ``reduce`` and ``update``, the bytes the stage holds for good
(parameters, gradients, optimizer state) and the activation bytes one
micro-batch keeps between its forward and backward.

What the stage is comes from a ``StageSpec`` built by the layer that knows
the recipe (``toolkit.search``): how to build the distributed module
and optimizer on a placement, and the global inputs of a micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime.pipeline.boundary import as_tuple
from sbp_core.global_tensor import GlobalTensor
from sbp_core.layout import Layout
from sbp_core.module import box_grads, defer_grad_boxing
from sbp_core.local_step import step_on_locals
from sbp_core.one_device import replicated
from sbp_core.placement import placement as make_placement
from .rehearsal import PhaseTrace, Rehearsal

PHASES = ("F", "B0", "B", "reduce", "update")


@dataclass
class StageSpec:
    """Everything ``trace_stage`` needs about one stage; the callables run inside the fake world.

    - ``build(placement) -> (module, optimizer, zero)``: the stage's module with its
      plan applied (``sc.distribute_module`` or ZeRO's rewrite), its optimizer,
      and the ZeRO strategy object (``None`` without ZeRO);
    - ``inputs(placement) -> (x, labels)``: one micro-batch's global inputs
      (the boundary's tensor, or a tuple of them, after the first stage;
      ``labels`` ``None`` unless ``last``); ``global_input`` builds them;
    - ``forward(module, x, labels)``: the stage output (a tensor or a tuple),
      or the loss when ``last``;
    - ``act_sbp``: the stage-boundary layout (outputs are boxed to it before
      they leave, input gradients before they go back); ``micro_batches``
      scales the loss like the runtime; ``grad_clip`` clips when set.
    """

    dp: int
    tp: int
    first: bool
    last: bool
    build: Callable
    inputs: Callable
    forward: Callable
    act_sbp: tuple
    micro_batches: int = 1
    grad_clip: float | None = None
    rows_weigh_equally: bool = False  # the recipe's (``toolkit.recipe.Recipe``): see ``StageTrace.plain``
    device_type: str = "cpu"


@dataclass
class StageTrace:
    """A stage's rehearsed step on rank 0 of its ``(dp, tp)`` mesh (ranks 0..dp*tp-1, tp innermost)."""

    dp: int
    tp: int
    phases: dict = field(default_factory=dict)  # name in PHASES -> PhaseTrace
    param_bytes: int = 0  # parameters (ZeRO masters and persistent compute copies included)
    grad_bytes: int = 0  # gradients as held after the reduction
    optimizer_bytes: int = 0  # optimizer state (e.g. AdamW's two moments)
    stash_bytes: int = 0  # what one micro-batch's forward leaves alive for its backward
    act_bytes: int = 0  # the boundary activation one micro-batch sends to the next stage (this rank's part)
    # The runtime runs the stage on plain tensors (no per-op dispatch): one device, or pure data parallel
    # (``sc.replicated``, not ZeRO, the recipe's rows weigh equally) assuming its first-step audit passes
    # (``runtime.pipeline.plain_stage``: BatchNorm or dropout would keep it dispatched).
    plain: bool = False


def global_input(shape, dtype, placement, sbp, requires_grad: bool = False) -> GlobalTensor:
    """A global tensor of ``shape`` laid out ``sbp`` whose local is an uninitialised tensor (fake in a rehearsal)."""
    layout = Layout(placement, tuple(sbp), torch.Size(shape), dtype)
    local = torch.empty(layout.local_shape(0), dtype=dtype, device=placement.device())
    return GlobalTensor(local, layout, requires_grad=requires_grad)


def _local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the locals of ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t._local if isinstance(t, GlobalTensor) else t
        try:
            st = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += int(st.nbytes())
    return total


def _optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def trace_stage(spec: StageSpec) -> StageTrace:
    """Rehearse one step of the stage described by ``spec`` (two micro-batches) and return its trace."""
    world = spec.dp * spec.tp
    out = StageTrace(spec.dp, spec.tp)
    with Rehearsal(world) as r:
        mesh = [[d * spec.tp + t for t in range(spec.tp)] for d in range(spec.dp)]
        placement = make_placement(spec.device_type, mesh)
        module, optimizer, zero = spec.build(placement)
        r.name_modules(module)
        out.plain = world == 1 or (spec.rows_weigh_equally and zero is None and replicated(module))
        for k in range(2):
            x, labels = spec.inputs(placement)
            with r.phase("F") as f:
                y = spec.forward(module, x, labels if spec.last else None)
                if not spec.last:  # the boundary's tensors: one, or a tuple
                    y = [t.to_global(sbp=spec.act_sbp) for t in as_tuple(y)]
            if k == 0:
                out.phases["F"] = f
                out.stash_bytes = f.end_bytes
                out.act_bytes = 0 if spec.last else _local_bytes(y)
            with r.phase("B0" if k == 0 else "B") as b:
                with defer_grad_boxing():
                    if spec.last:
                        (y / spec.micro_batches).backward()
                    else:
                        ys = [t for t in y if t.requires_grad]
                        torch.autograd.backward(ys, [global_input(t.shape, t.dtype, placement, spec.act_sbp)
                                                     for t in ys])
                for t in () if spec.first else as_tuple(x):
                    if isinstance(t, GlobalTensor) and t.grad is not None:
                        t.grad.to_global(sbp=spec.act_sbp)
            out.phases[b.name] = b
            del x, labels, y
        with r.phase("reduce") as red:
            # as runtime.pipeline.step: ZeRO syncs its own gradients
            zero.sync_grads() if zero is not None else box_grads(module)
        out.phases["reduce"] = red
        with r.phase("update") as up:
            if spec.grad_clip:
                from sbp_core.grad_clip import clip_grad_norm_

                clip_grad_norm_([p for p in module.parameters() if p.grad is not None], spec.grad_clip)
            step_on_locals(optimizer)  # as runtime.pipeline.step: locals for an element-wise optimizer
            if zero is not None:
                zero.refresh()
        out.phases["update"] = up
        params = list(module.parameters())
        out.param_bytes = _local_bytes(params)
        out.grad_bytes = _local_bytes([p.grad for p in params])
        out.optimizer_bytes = _local_bytes(_optimizer_tensors(optimizer))
    return out


def phase(trace: StageTrace, name: str) -> PhaseTrace:
    if name not in trace.phases:
        raise KeyError(f"phase {name!r} is not one of {sorted(trace.phases)}")
    return trace.phases[name]
