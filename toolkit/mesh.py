"""The device mesh of a ``dpD_tpT_ppP`` job: one ``(D, T)`` placement per pipeline stage.

docs/design.md's rank layout: pp outermost, tp innermost,
``rank = pp_i*D*T + dp_i*T + tp_i``. Every rank builds every stage's
placement, in stage order (building a placement creates its process groups,
a collective over the world).
"""
from __future__ import annotations

import fnmatch

import sbp_core as sc


def stage_ranks(dp: int, tp: int, pp: int) -> list:
    """``pp`` nested lists ``[[rank for tp] for dp]``."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return [[[s * dp * tp + d * tp + t for t in range(tp)] for d in range(dp)] for s in range(pp)]


def stage_placements(dp: int, tp: int, pp: int, device_type: str = "cpu") -> list:
    return [sc.placement(device_type, ranks) for ranks in stage_ranks(dp, tp, pp)]


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
    """``plan`` with per-op layouts first: ``{pattern: tp-axis SBP text}`` -> ``(B, SBP)`` on a ``(dp, tp)`` mesh.

    ``distribute_module`` takes the first matching pattern, so an override
    wins over the recipe's entry for the same parameters.
    """
    from toolkit.search.strategy import parse_sbp

    first = {str(k): (sc.sbp.broadcast, parse_sbp(v)) for k, v in dict(overrides or {}).items()}
    return {**first, **{k: v for k, v in plan.items() if k not in first}}
