"""An element-wise optimizer steps the parameters' local tensors: no op dispatch, state kept global.

AdamW over global tensors runs ~12 ops per parameter (``lerp_``, ``mul_``,
``addcmul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``...), each through
``GlobalTensor.__torch_dispatch__``. When a parameter and its gradient (and
the optimizer's state) share one layout, every one of those ops takes the
signature "same layout in, same layout out, run on the locals" — an
element-wise update needs no communication in any SBP but partial (a
nonlinear update of partial terms is not the update of their sum; such a
parameter keeps the dispatched step). So the same update is the optimizer's own step on the
local tensors: on ``S`` the shard of the global update, on ``B`` each
replica's (identical) copy. ``step_on_locals(optimizer)`` runs
``optimizer.step()`` that way, bit for bit the dispatched path's values:

- for the step, each group's global parameters are swapped for their
  ``_local`` tensors (same storage, so the in-place update is the global
  parameter's), each local gets ``grad._local`` as its ``.grad``, and the
  optimizer's state is its view keyed by the locals, every global state
  tensor replaced by its local (same storage again). The view
  (``_LocalView``) is kept from one step to the next while it still
  describes the optimizer, so a step in the steady state re-keys nothing;
- afterwards the groups get their global parameters back, the locals drop
  their ``.grad``, and what the step added to the state (``exp_avg`` and
  ``exp_avg_sq`` on the first step, ``momentum_buffer``) is written to the
  global state wrapped in its parameter's layout, so ``state_dict``,
  checkpoints (``toolkit.checkpoint.optimizer``: global state by name,
  reloadable in any layout) and later dispatched steps see what the
  dispatched step would have left.

Only optimizers whose update is element-wise per parameter qualify
(``ELEMENTWISE``: SGD, Adam, AdamW, not their subclasses, which may add a
reduction); a step where some gradient is not a dense global tensor in its
parameter's layout (a sparse row gradient, or one not yet boxed), some
parameter is laid out partial, or the optimizer has step hooks (they would
see the locals) runs the ordinary dispatched ``optimizer.step()``. With locals on CUDA torch picks its
``foreach`` kernels by itself, which it never does for a tensor subclass.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch

from .global_tensor import GlobalTensor

#: Optimizers whose update of a parameter reads only that parameter's elements, gradient and state.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
#: Their per-element state (laid out like the parameter); any other key (``step``) is a plain scalar.
_PER_ELEMENT = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})


def steps_on_locals(optimizer: torch.optim.Optimizer) -> bool:
    """Can ``optimizer`` step its parameters' locals (element-wise update, no step hooks)?

    A subclass of one of ``ELEMENTWISE`` qualifies when it says so with a class attribute
    ``elementwise = True`` (its own additions read only each parameter's elements too, and
    find the parameter it keeps extra state for among its groups' tensors, which are the
    locals during the step)."""
    kind = type(optimizer)
    return ((kind in ELEMENTWISE or (getattr(kind, "elementwise", False) is True and issubclass(kind, ELEMENTWISE)))
            and _no_step_hooks(optimizer))


def _no_step_hooks(optimizer) -> bool:
    """No step hooks, which would see the locals (or the local gradients) instead of the global tensors."""
    return not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def _steps_with_grads(optimizer) -> bool:
    """Does the optimizer's class declare its own ``step(grads=...)`` (``takes_local_grads = True``)?"""
    return getattr(type(optimizer), "takes_local_grads", False) is True


def takes_local_grads(optimizer: torch.optim.Optimizer, sparse: bool = False) -> bool:
    """Can ``step_on_locals(optimizer, grads)`` step it with a one-device step's plain gradients?

    An element-wise optimizer (``steps_on_locals``) takes dense ones. An optimizer whose class says
    ``takes_local_grads = True`` takes them in its own ``step(grads=...)``, sparse ones too
    (``toolkit.lazy_adam.LazyAdamW``: lazy Adam on row gradients). ``sparse``: some gradient is sparse."""
    if _steps_with_grads(optimizer):
        return _no_step_hooks(optimizer)
    return not sparse and steps_on_locals(optimizer)


def updates_locally(p) -> bool:
    """Is ``p``'s update its locals' update: no partial value (an element-wise update of partial
    terms is not the update of their sum), and its gradient absent or dense in ``p``'s layout?
    A plain tensor is its own local: yes."""
    if not isinstance(p, GlobalTensor):
        return True
    if _laid_out_partial(p):
        return False
    g = p.grad
    return g is None or _in_layout_of(g, p)


def _laid_out_partial(p) -> bool:
    """Is global tensor ``p`` a partial value on some mesh axis?"""
    return any(s.is_partial for s in p._layout.sbp)


def _in_layout_of(g, p) -> bool:
    """Is gradient ``g`` a dense global tensor in global parameter ``p``'s layout?"""
    return type(g) is GlobalTensor and (g._layout is p._layout or g._layout == p._layout)


def step_on_locals(optimizer: torch.optim.Optimizer, grads: dict | None = None) -> None:
    """``optimizer.step()`` on the global parameters' local tensors (module docstring); same values.

    Falls back to the dispatched ``optimizer.step()`` when ``steps_on_locals``
    is false, a parameter is laid out partial or a gradient is not in its
    parameter's layout. No communication.

    ``grads``: ``{id(parameter): its local gradient or None}``, the gradients
    of a one-device step that never became global (``LocalParameters.restore(
    hand_grads=False)``), taken instead of the parameters' ``.grad``; then the
    step must run on the locals (``ValueError`` where it cannot), or be the
    optimizer's own ``step(grads=grads)`` where it declares
    ``takes_local_grads`` (``takes_local_grads``).
    """
    if grads is not None and _steps_with_grads(optimizer):
        if not _no_step_hooks(optimizer):
            raise ValueError(f"{type(optimizer).__name__} has step hooks, which would see local gradients: "
                             "its gradients must be handed to the parameters")
        optimizer.step(grads=grads)
        return
    if not steps_on_locals(optimizer):
        if grads is not None:
            raise ValueError(f"{type(optimizer).__name__} cannot step its parameters' locals (not element-wise, "
                             "or it has step hooks): its gradients must be handed to the parameters")
        _dispatched_step(optimizer)
        return
    view = _VIEWS.get(optimizer)
    if view is None or not view.holds(optimizer):
        view = _VIEWS[optimizer] = _LocalView(optimizer)
    if grads is not None:
        if view.partial:
            raise ValueError("a parameter laid out partial cannot step its local: its gradients must be handed over")
        for p, t in view.pairs:
            t.grad = grads.get(id(p))
    elif view.partial or not view.take_grads():
        _dispatched_step(optimizer)
        return
    groups, state = optimizer.param_groups, optimizer.state
    for g, locals_ in zip(groups, view.locals):
        g["params"] = locals_
    optimizer.state = view.local_state
    try:
        optimizer.step()
    finally:
        for g, ps in zip(groups, view.members):
            g["params"] = ps
        optimizer.state = state
        for _, t in view.pairs:
            t.grad = None
        view.write_back()


class _LocalView:
    """An optimizer's groups and state on its global parameters' locals, kept from one step to the next.

    ``locals``: each group's parameter list with every global parameter
    replaced by its local (same storage); ``local_state``: the optimizer's
    state keyed by those locals, each global state tensor replaced by its
    local (same storage again; a plain parameter's entry is its own dict).
    So a step's in-place updates are the global state's, and only what a
    step adds (the first step's ``exp_avg``, ``momentum_buffer``) is written
    back (``write_back``), wrapped in its parameter's layout. ``holds`` says
    whether the view still describes the optimizer: the same state object
    and groups, every global parameter's local the one it holds, and every
    global state entry the wrapper of its local entry; anything else (a
    loaded state dict, a replaced entry, a new group) rebuilds it.
    """

    def __init__(self, optimizer):
        self.state = state = optimizer.state
        self.groups = list(optimizer.param_groups)
        self.members = [g["params"] for g in self.groups]
        self.locals = [[p._local if isinstance(p, GlobalTensor) else p for p in ps] for ps in self.members]
        self.pairs = [(p, p._local) for ps in self.members for p in ps if isinstance(p, GlobalTensor)]
        self.plain = [p for ps in self.members for p in ps if not isinstance(p, GlobalTensor)]
        self.partial = any(_laid_out_partial(p) for p, _ in self.pairs)  # (updates_locally)
        self.local_state = local_state = defaultdict(dict)  # as torch keeps it: a step creates entries by lookup
        for ps in self.members:
            for p in ps:
                s = state.get(p)
                if s is None:
                    continue
                if isinstance(p, GlobalTensor):
                    local_state[p._local] = {k: v._local if isinstance(v, GlobalTensor) else v for k, v in s.items()}
                else:
                    local_state[p] = s

    def holds(self, optimizer) -> bool:
        groups = optimizer.param_groups
        if optimizer.state is not self.state or len(groups) != len(self.groups):
            return False
        if any(g is not mine or g["params"] is not ps for g, mine, ps in zip(groups, self.groups, self.members)):
            return False
        state, local_state = self.state, self.local_state
        for p, t in self.pairs:
            if p._local is not t:
                return False
            s, ls = state.get(p), local_state.get(t)
            if s is None or ls is None:
                if s is not None or ls:
                    return False
                continue
            if len(s) != len(ls):
                return False
            for k, v in s.items():
                if (v._local if type(v) is GlobalTensor else v) is not ls.get(k, _MISSING):
                    return False
        return True

    def take_grads(self) -> bool:
        """Each local gets its parameter's gradient's local; ``False`` (and none does) when some gradient
        is not a dense global tensor in its parameter's layout (``updates_locally``)."""
        for p, t in self.pairs:
            g = p.grad
            if g is None:
                t.grad = None
            elif _in_layout_of(g, p):
                t.grad = g._local
            else:
                for _, u in self.pairs:
                    u.grad = None
                return False
        return True

    def write_back(self) -> None:
        """Give the global state what the step added or replaced: per-element tensors wrapped in their
        parameter's layout, anything else as it is (a plain parameter's state is its own dict)."""
        state, local_state = self.state, self.local_state
        for p, t in self.pairs:
            ls = local_state.get(t)
            if not ls:
                continue
            s = state.get(p)
            if s is None:
                s = state[p] = {}
            for k, v in ls.items():
                old = s.get(k, _MISSING)
                if old is v or (type(old) is GlobalTensor and old._local is v):
                    continue
                s[k] = GlobalTensor(v, p._layout) if k in _PER_ELEMENT else v
        for p in self.plain:
            if p in local_state and state.get(p) is not local_state[p]:
                state[p] = local_state[p]


_MISSING = object()
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its _LocalView


def _may_step_locals(optimizer) -> bool:
    """Can a later ``step_on_locals`` step ``optimizer`` on its locals (gradients in layout permitting)?"""
    return steps_on_locals(optimizer) and not any(
        type(p) is GlobalTensor and _laid_out_partial(p) for g in optimizer.param_groups for p in g["params"])


def _dispatched_step(optimizer) -> None:
    """``optimizer.step()`` on the global parameters, with any ``fused`` kernel switched off for it.

    A fused step is one aten op over lists of tensors, which has no SBP rule;
    its single-tensor ops (the same update) do. Those keep a new ``step``
    count on the host. Where a later step may run fused on the locals
    (``steps_on_locals``, no partial parameter), which hands it to a CUDA
    kernel, it moves to its parameter's device, as fused state is; an
    optimizer that always takes this path keeps it on the host, where the
    single-tensor ops read it without waiting for the device.
    A ``found_inf`` flag on the optimizer (fp16's overflow, ``LossScaler``),
    which only the fused kernels read, is read here: a step that overflowed
    is skipped, and the single-tensor update, which refuses the flag, runs
    without it (it is back on the optimizer after). A ``grad_scale`` (scaled
    gradients the fused kernel would unscale) is refused: the gradients must
    be unscaled first, as ``LossScaler`` does.
    """
    if getattr(optimizer, "grad_scale", None) is not None:
        raise ValueError(f"{type(optimizer).__name__}.grad_scale is set, but this step runs unfused on global "
                         "tensors: unscale the gradients first (sc.LossScaler's unscale) and leave grad_scale None")
    found = getattr(optimizer, "found_inf", None)
    if found is not None and float(found):  # only a fused kernel skips by the flag: the host decides here
        return
    fused = [g for g in optimizer.param_groups if g.get("fused")]
    for g in fused:
        g["fused"] = False
    if found is not None:
        optimizer.found_inf = None
    try:
        optimizer.step()
    finally:
        if found is not None:
            optimizer.found_inf = found
        for g in fused:
            g["fused"] = True
        for g in fused if _may_step_locals(optimizer) else ():
            for p in g["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    optimizer.state[p]["step"] = step.to(p.device, torch.float32)
