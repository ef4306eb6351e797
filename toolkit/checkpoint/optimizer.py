"""Optimizer state keyed by parameter *names*, so any layout and any stage split can reload it.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position
in its groups; a pipeline stage, or a run with another parameter order,
numbers them differently. :func:`optimizer_state_dict` keys the per-parameter
state by name (global tensors stay global: AdamW's ``exp_avg`` of a
``(B, S(1))`` weight is a ``(B, S(1))`` global tensor) and keeps each group's
hyper-parameters (``lr``, ``betas``, a scheduler's ``initial_lr``...).
Loading keeps the current optimizer's member lists (``params``, and
``names``/``param_names`` if the groups carry them) and its kernel flags
(``fused``, ``foreach``, ``capturable``: a checkpoint saved on CPU, where the
optimizer is not fused, resumes fused on CUDA, its ``step`` counters placed
for that kernel)::

    {"state": {"transformer.h.0.attn.c_attn.weight": {"step": t, "exp_avg": g, "exp_avg_sq": g}, ...},
     "param_groups": [{"lr": 6e-4, "betas": (0.9, 0.95), ...}, ...]}

Groups are matched by position when loading: every layout must build the
same groups (e.g. decay / no-decay), each stage with its own members.

Before its first step an optimizer holds no state to serve as a load
template; :func:`optimizer_state_dict` then puts a :class:`StateLike` slot
for the parameter, and ``load`` creates whatever the checkpoint holds there:
tensors of the parameter's shape in the parameter's layout, others (AdamW's
``step``) as plain tensors.
"""
from __future__ import annotations

from torch import nn

from .errors import CheckpointError

# Group keys that list the group's members: kept from the current optimizer, never saved
# (a pipeline stage's groups hold other members than the checkpoint's).
_MEMBER_KEYS = ("params", "names", "param_names")
# Group keys that choose the kernel for this run's devices (and whether autograd records the step), not
# the arithmetic: kept from the current optimizer. They are in place before torch loads the state, which
# places ``step`` for them (on the parameter's device for ``fused``/``capturable``, a CPU scalar otherwise).
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


class StateLike:
    """Load-template slot: "this parameter's optimizer state, laid out like ``param``"."""

    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param

    def __repr__(self):
        return f"StateLike(shape={tuple(self.param.shape)})"


def _names(named_params) -> dict:
    if isinstance(named_params, nn.Module):
        named_params = named_params.named_parameters()
    elif isinstance(named_params, dict):
        named_params = named_params.items()
    return {id(p): n for n, p in named_params}


def _named_groups(optimizer, named_params):
    names = _names(named_params)
    for gi, group in enumerate(optimizer.param_groups):
        out = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer group {gi} holds a parameter of shape {tuple(p.shape)} that is not "
                                 f"among the {len(names)} named parameters given")
            out.append((names[id(p)], p))
        yield group, out


def optimizer_state_dict(optimizer, named_params) -> dict:
    """``optimizer``'s state keyed by parameter name (``named_params``: a module, a dict or ``(name, param)`` pairs).

    The tensors are the optimizer's own (no copy): use it right away for
    ``save``, or as a ``load`` template that is then filled in place.
    """
    state, groups = {}, []
    for group, members in _named_groups(optimizer, named_params):
        groups.append({k: v for k, v in group.items() if k not in _MEMBER_KEYS})
        for name, p in members:
            s = optimizer.state.get(p)
            state[name] = dict(s) if s else StateLike(p)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(optimizer, named_params, saved: dict) -> None:
    """Give ``optimizer`` the state ``saved`` (as returned by ``load`` for an :func:`optimizer_state_dict` template)."""
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                              f"{len(optimizer.param_groups)}: build the groups the same way in every layout")
    torch_sd = {"state": {}, "param_groups": []}
    index = 0
    for (group, members), hyper in zip(_named_groups(optimizer, named_params), groups):
        ids = []
        for name, _ in members:
            s = saved["state"].get(name)
            if isinstance(s, dict) and s:
                torch_sd["state"][index] = s
            ids.append(index)
            index += 1
        kept = {k: group[k] for k in _MEMBER_KEYS + _KERNEL_KEYS if k in group and k != "params"}
        torch_sd["param_groups"].append({**hyper, **kept, "params": ids})
    optimizer.load_state_dict(torch_sd)
