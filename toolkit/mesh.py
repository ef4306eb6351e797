"""The device mesh of a ``dpD_cpC_tpT_ppP`` job: one ``(D, T)`` placement per pipeline stage, ``(D, C, T)`` with
context parallelism.

docs/design.md's rank layout: pp outermost, tp innermost,
``rank = pp_i*D*C*T + dp_i*C*T + cp_i*T + tp_i``. Every rank builds every
stage's placement, in stage order (building a placement creates its process
groups, a collective over the world).

A recipe's plan and layouts are written for the ``(dp, tp)`` mesh;
``context_plan`` and ``with_context`` put the cp axis between them:
parameters whole on it (``B``; their gradients are reduced over it as over
dp), the batch, the activation pins and the stage boundaries split on the
recipe's sequence dim.
"""
from __future__ import annotations

import fnmatch

import sbp_core as sc
from sbp_core.sbp import Broadcast, Split


def stage_ranks(dp: int, tp: int, pp: int, cp: int = 1) -> list:
    """``pp`` nested lists ``[[rank for tp] for dp]``; with ``cp > 1`` ``[[[rank for tp] for cp] for dp]``."""
    for name, v in (("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if cp == 1:
        return [[[s * dp * tp + d * tp + t for t in range(tp)] for d in range(dp)] for s in range(pp)]
    return [[[[((s * dp + d) * cp + c) * tp + t for t in range(tp)] for c in range(cp)] for d in range(dp)]
            for s in range(pp)]


def stage_placements(dp: int, tp: int, pp: int, device_type: str = "cpu", cp: int = 1) -> list:
    return [sc.placement(device_type, ranks) for ranks in stage_ranks(dp, tp, pp, cp)]


def with_context(sbp: tuple, cp: int, dim: int) -> tuple:
    """A ``(dp, tp)`` layout of the batch, an activation pin or a stage boundary on the ``(dp, cp, tp)`` mesh:
    ``S(dim)`` (the sequence) on the cp axis; unchanged when ``cp == 1``."""
    return sbp if cp == 1 else (sbp[0], Split(dim), *sbp[1:])


def context_plan(plan: dict, cp: int, dim: int) -> dict:
    """``plan`` on the ``(dp, cp, tp)`` mesh: parameters and buffers ``B`` on the cp axis, activation pins (keys
    ``module:input``) split on the sequence dim ``dim``; unchanged when ``cp == 1``."""
    if cp == 1:
        return plan
    return {k: with_context(v, cp, dim) if ":" in k else (v[0], Broadcast(), *v[1:]) for k, v in plan.items()}


def model_names(model) -> tuple:
    """Every parameter (tied ones under each name), buffer and module name of ``model`` (``plan_for_module``'s ``full_names``)."""
    return tuple({n for n, _ in model.named_parameters(remove_duplicate=False)}
                 | {n for n, _ in model.named_buffers()} | {n for n, _ in model.named_modules()})


def plan_for_module(module, plan: dict, full_names: tuple) -> dict:
    """The entries of ``plan`` that match something in ``module`` (a pipeline stage of a model).

    ``full_names`` (parameter, buffer and module names of the whole model)
    catch misspelt keys, which would otherwise match nothing on any stage.
    """
    here = {n for n, _ in module.named_parameters(remove_duplicate=False)} | {n for n, _ in module.named_buffers()} | {
        n for n, _ in module.named_modules()}
    out = {}
    for key, sbp in plan.items():
        target = key.partition(":")[0]
        if not any(fnmatch.fnmatchcase(n, target) for n in full_names):
            raise ValueError(f"plan key {key!r} matches nothing in the model; some names: {sorted(full_names)[:8]}")
        if any(fnmatch.fnmatchcase(n, target) for n in here):
            out[key] = sbp
    return out


def with_overrides(plan: dict, overrides) -> dict:
    """``plan`` with per-op layouts first: ``{pattern: tp-axis SBP text}`` -> ``(dp SBP, SBP)`` on a ``(dp, tp)``
    mesh, the dp SBP the recipe's first entry matching the pattern has (``B`` without one: an expert split
    over dp stays split when its tp layout is overridden).

    ``distribute_module`` takes the first matching pattern, so an override
    wins over the recipe's entry for the same parameters.
    """
    from toolkit.search.strategy import parse_sbp

    def dp_sbp(key: str):
        return next((v[0] for k, v in plan.items() if fnmatch.fnmatchcase(key, k)), sc.sbp.broadcast)

    first = {str(k): (dp_sbp(str(k)), parse_sbp(v)) for k, v in dict(overrides or {}).items()}
    return {**first, **{k: v for k, v in plan.items() if k not in first}}
