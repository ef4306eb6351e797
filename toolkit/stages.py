"""Pipeline stages from a plan: which layers each stage holds, and the stage's module.

A recipe's pipeline plan is data::

    {"layers": "transformer.h",                      # the ModuleList of repeated layers
     "first": ["transformer.wte", "transformer.wpe"], # modules before the layers (stage 0)
     "last": ["transformer.ln_f", "lm_head"]}         # modules after them (last stage)

``layers`` may also list several ``ModuleList``/``Sequential`` containers
(a ResNet's four stages of blocks): their layers, concatenated in order,
are the unit of the split, which is where a stage's output may change shape
(``boundary_specs``). ``stage_ranges`` assigns layer indices to stages
(uniform by default, or explicit counts); ``keep_stage`` turns a full
model into one stage's module in place by setting every other module to
``None`` (the model's ``forward`` skips absent modules), so parameter
names stay the full model's.
``boundary_specs`` finds what crosses each stage boundary by running the
stages on meta tensors. ``tied_names`` lists parameters that one module object shares under several
names (GPT-2's embedding and LM head): after a split they are separate
copies on the first and last stage, which the pipeline keeps equal by
summing their gradients.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from runtime.pipeline.boundary import as_tuple


def stage_ranges(n_layers: int, pp: int, counts=None) -> list:
    """``pp`` ranges of layer indices; ``counts`` (layers per stage) overrides the uniform split.

    Uniform needs ``pp`` to divide ``n_layers``; every stage must hold at
    least one layer.
    """
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if counts is None:
        if n_layers % pp:
            raise ValueError(f"{n_layers} layers cannot be split uniformly into pp={pp} stages: "
                             f"use a pp that divides {n_layers} or give layers per stage (stage_layers)")
        counts = [n_layers // pp] * pp
    counts = list(counts)
    if len(counts) != pp:
        raise ValueError(f"stage_layers {counts} lists {len(counts)} stages but pp={pp}")
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"stage_layers {counts}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise ValueError(f"stage_layers {counts} sum to {sum(counts)}, but the model has {n_layers} layers")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def _get(model: nn.Module, path: str):
    mod = model
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod


def _containers(model: nn.Module, plan: dict) -> list:
    """``[(path, container)]`` of the plan's ``layers`` (one path or a list), each a ModuleList or Sequential."""
    paths = [plan["layers"]] if isinstance(plan["layers"], str) else list(plan["layers"])
    out = []
    for path in paths:
        mods = _get(model, path)
        if not isinstance(mods, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"pipeline plan 'layers' = {path!r} must name an nn.ModuleList or nn.Sequential, "
                            f"got {type(mods).__name__}")
        out.append((path, mods))
    return out


def layer_paths(model: nn.Module, plan: dict) -> list:
    """The module path of every repeated layer, in order (``"transformer.h.0"``, ..., ``"backbone.layer4.2"``)."""
    return [f"{path}.{name}" for path, mods in _containers(model, plan) for name in mods._modules]


def layers_of(model: nn.Module, plan: dict) -> list:
    """The repeated layers (``None`` where a stage dropped one), in order."""
    return [m for _, mods in _containers(model, plan) for m in mods._modules.values()]


def _drop(model: nn.Module, path: str) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(model, parent) if parent else model, name, None)


def tied_names(model: nn.Module) -> list:
    """Groups of names under which one parameter object appears, e.g. ``[("transformer.wte.weight", "lm_head.weight")]``."""
    seen: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [tuple(v) for v in seen.values() if len(v) > 1]


def keep_stage(model: nn.Module, plan: dict, ranges: list, stage: int) -> nn.Module:
    """``model`` with only stage ``stage``'s modules (in place; returns it)."""
    n = len(layer_paths(model, plan))
    if sum(len(r) for r in ranges) != n:
        raise ValueError(f"stage ranges cover {sum(len(r) for r in ranges)} layers, {plan['layers']} has {n}")
    return keep_layers(model, plan, ranges[stage], stage == 0, stage == len(ranges) - 1)


def keep_layers(model: nn.Module, plan: dict, layers, first: bool, last: bool) -> nn.Module:
    """``model`` with only the repeated layers in ``layers``, and the first/last modules if ``first``/``last`` (in place)."""
    i = 0
    for _, mods in _containers(model, plan):
        for name in list(mods._modules):
            if i not in layers:
                mods._modules[name] = None
            i += 1
    if not first:
        for path in plan.get("first", ()):
            _drop(model, path)
    if not last:
        for path in plan.get("last", ()):
            _drop(model, path)
    return model


def keep_stages(model: nn.Module, plan: dict, ranges: list, stages: list) -> nn.Module:
    """``model`` with every stage in ``stages`` kept (in place; returns it): one rank's module when it holds
    several stages (virtual pipeline stages), under the full model's names, tied parameters one object."""
    n = len(layer_paths(model, plan))
    if sum(len(r) for r in ranges) != n:
        raise ValueError(f"stage ranges cover {sum(len(r) for r in ranges)} layers, {plan['layers']} has {n}")
    layers = [i for s in stages for i in ranges[s]]
    return keep_layers(model, plan, layers, 0 in stages, len(ranges) - 1 in stages)


def chunk_views(module: nn.Module, plan: dict, ranges: list, stages: list) -> dict:
    """``{stage: view}``: a module per stage of ``module`` (``keep_stages``) that runs that stage's forward.

    A view is a shallow copy of ``module`` along the paths to the plan's
    containers and first/last modules, with the other stages' modules
    absent; it shares every parameter, buffer, hook and layer with
    ``module`` (so ZeRO's and activation checkpointing's changes to them,
    made before or after, are the view's too).
    """
    n = len(ranges)
    return {s: keep_layers(_view(module, plan), plan, ranges[s], s == 0, s == n - 1) for s in stages}


def _view(model: nn.Module, plan: dict) -> nn.Module:
    """A copy of ``model`` whose modules on the paths to the plan's containers and first/last modules are new
    objects (so ``keep_layers`` can drop modules from it) and whose other modules are ``model``'s own."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    copied = {"": root}
    paths = [plan["layers"]] if isinstance(plan["layers"], str) else list(plan["layers"])
    parents = [p.rpartition(".")[0] for p in (*plan.get("first", ()), *plan.get("last", ()))]
    for path in paths + [p for p in parents if p]:
        at = ""
        for part in path.split("."):
            here = f"{at}.{part}" if at else part
            if here not in copied:
                mod = copy.copy(copied[at]._modules[part])
                mod._modules = dict(mod._modules)
                copied[at]._modules[part] = copied[here] = mod
            at = here
    return root


def boundary_specs(build, forward, plan: dict, ranges: list, batch: dict, inputs: tuple) -> list:
    """Per stage boundary, the ``(shape, dtype)`` of each tensor the stage before it returns, in order.

    Runs stages ``0 .. pp - 2`` on meta tensors (shapes only; no memory, no
    data): each a fresh ``build()`` made under the meta device and cut to
    its stage (``keep_stage``), fed the micro-batch's ``inputs`` fields
    (``batch``: ``{field: (global shape, dtype)}``) or the previous stage's
    outputs, through ``forward(module, x, None)``. So the shapes and dtypes
    are those the real stages produce in the model's own precision (a
    boundary's cut casts to them). The global RNG is left as it was.
    """
    specs, x = [], None
    with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.no_grad():
        for stage in range(len(ranges) - 1):
            module = keep_stage(build(), plan, ranges, stage)
            if stage == 0:
                x = {k: torch.empty(batch[k][0], dtype=batch[k][1]) for k in inputs}
            out = as_tuple(forward(module, x, None))
            specs.append(tuple((tuple(t.shape), t.dtype) for t in out))
            x = out[0] if len(out) == 1 else out
    return specs
