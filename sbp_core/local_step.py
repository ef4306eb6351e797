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
  optimizer's state is re-keyed by the locals with every global state
  tensor replaced by its local (same storage again);
- afterwards the groups get their global parameters back, the locals drop
  their ``.grad``, and the state is keyed by the global parameters again:
  tensors the step created (``exp_avg`` and ``exp_avg_sq`` on the first step,
  ``momentum_buffer``) are wrapped in their parameter's layout, so
  ``state_dict``, checkpoints (``toolkit.checkpoint.optimizer``: global
  state by name, reloadable in any layout) and later dispatched steps see what
  the dispatched step would have left.

Only optimizers whose update is element-wise per parameter qualify
(``ELEMENTWISE``: SGD, Adam, AdamW, not their subclasses, which may add a
reduction); a step where some gradient is not a dense global tensor in its
parameter's layout (a sparse row gradient, or one not yet boxed), some
parameter is laid out partial, or the optimizer has step hooks (they would
see the locals) runs the ordinary dispatched ``optimizer.step()``. With locals on CUDA torch picks its
``foreach`` kernels by itself, which it never does for a tensor subclass.
"""
from __future__ import annotations

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
            and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks)


def updates_locally(p) -> bool:
    """Is ``p``'s update its locals' update: no partial value (an element-wise update of partial
    terms is not the update of their sum), and its gradient absent or dense in ``p``'s layout?
    A plain tensor is its own local: yes."""
    if not isinstance(p, GlobalTensor):
        return True
    if any(s.is_partial for s in p._layout.sbp):
        return False
    g = p.grad
    return g is None or (type(g) is GlobalTensor and (g._layout is p._layout or g._layout == p._layout))


def step_on_locals(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` on the global parameters' local tensors (module docstring); same values.

    Falls back to the dispatched ``optimizer.step()`` when ``steps_on_locals``
    is false, a parameter is laid out partial or a gradient is not in its
    parameter's layout. No communication.
    """
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"] if isinstance(p, GlobalTensor)]
    if not steps_on_locals(optimizer) or not all(updates_locally(p) for p in params):
        _dispatched_step(optimizer)
        return
    state = optimizer.state
    local_state, swapped, plain = defaultdict(dict), [], []
    members = [g["params"] for g in groups]
    for g in groups:
        locals_ = []
        for p in g["params"]:
            if not isinstance(p, GlobalTensor):  # a plain parameter steps as it is
                locals_.append(p)
                plain.append(p)
                if p in state:
                    local_state[p] = state[p]
                continue
            t = p._local
            t.grad = None if p.grad is None else p.grad._local
            s = state.get(p)
            if s:
                local_state[t] = {k: v._local if isinstance(v, GlobalTensor) else v for k, v in s.items()}
            swapped.append((p, t, s))
            locals_.append(t)
        g["params"] = locals_
    optimizer.state = local_state
    try:
        optimizer.step()
    finally:
        for g, ps in zip(groups, members):
            g["params"] = ps
        for p, t, old in swapped:
            t.grad = None
            new = local_state.get(t)
            if new:
                state[p] = {k: _global_state(k, v, p, old) for k, v in new.items()}
        for p in plain:
            if p in local_state:
                state[p] = local_state[p]
        optimizer.state = state


def _dispatched_step(optimizer) -> None:
    """``optimizer.step()`` on the global parameters, with any ``fused`` kernel switched off for it.

    A fused step is one aten op over lists of tensors, which has no SBP rule;
    its single-tensor ops (the same update) do.
    """
    fused = [g for g in optimizer.param_groups if g.get("fused")]
    for g in fused:
        g["fused"] = False
    try:
        optimizer.step()
    finally:
        for g in fused:
            g["fused"] = True


def _global_state(key: str, value, p: GlobalTensor, old: dict | None):
    """The state entry ``key`` of ``p`` as the dispatched step keeps it: per-element tensors in ``p``'s layout."""
    if old is not None:
        prev = old.get(key)
        if isinstance(prev, GlobalTensor) and prev._local is value:  # updated in place: the same wrapper
            return prev
    if key in _PER_ELEMENT:
        return GlobalTensor(value, p._layout)
    return value
