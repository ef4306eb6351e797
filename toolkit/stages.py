"""Pipeline stages from a plan: which layers each stage holds, and the stage's module.

A recipe's pipeline plan is data::

    {"layers": "transformer.h",                      # the ModuleList of repeated layers
     "first": ["transformer.wte", "transformer.wpe"], # modules before the layers (stage 0)
     "last": ["transformer.ln_f", "lm_head"]}         # modules after them (last stage)

``stage_ranges`` assigns layer indices to stages (uniform by default, or
explicit counts); ``keep_stage`` turns a full model into one stage's module
in place by setting every other module to ``None`` (the model's ``forward``
skips absent modules), so parameter names stay the full model's.
``tied_names`` lists parameters that one module object shares under several
names (GPT-2's embedding and LM head): after a split they are separate
copies on the first and last stage, which the pipeline keeps equal by
summing their gradients.
"""
from __future__ import annotations

from torch import nn


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
    layers = _get(model, plan["layers"])
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"pipeline plan 'layers' = {plan['layers']!r} must name an nn.ModuleList, got {type(layers).__name__}")
    if sum(len(r) for r in ranges) != len(layers):
        raise ValueError(f"stage ranges cover {sum(len(r) for r in ranges)} layers, {plan['layers']} has {len(layers)}")
    return keep_layers(model, plan, ranges[stage], stage == 0, stage == len(ranges) - 1)


def keep_layers(model: nn.Module, plan: dict, layers, first: bool, last: bool) -> nn.Module:
    """``model`` with only the repeated layers in ``layers``, and the first/last modules if ``first``/``last`` (in place)."""
    mods = _get(model, plan["layers"])
    for i in range(len(mods)):
        if i not in layers:
            mods[i] = None
    if not first:
        for path in plan.get("first", ()):
            _drop(model, path)
    if not last:
        for path in plan.get("last", ()):
            _drop(model, path)
    return model
