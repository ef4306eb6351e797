"""A recipe's pipeline stage under a ``Strategy``, as ``sbp_core.search`` rehearses it.

Builds the same stage module the trainer builds (``toolkit.trainer.Job``):
the full model from the recipe, ``keep_stage`` for stage ``s``, the
recipe's plan with the strategy's per-op overrides on top, ZeRO's rewrite or
``distribute_module``, and the recipe's optimizer; and one micro-batch's
global inputs. ``blocks`` rebuilds the model with that many repeated layers
on this stage (plus one on each neighbouring stage) so that a deep stage
can be priced from two shallow rehearsals (``toolkit.autoparallel.profiles``).
"""
from __future__ import annotations

import copy

import torch

import sbp_core as sc
from sbp_core.search.stage_trace import StageSpec, global_input
from sbp_core.search.strategy import Strategy
from toolkit.mesh import plan_for_module
from toolkit.optim import build_optimizer
from toolkit.stages import keep_stage, stage_ranges


def stage_layers(n_layer: int, pp: int) -> list:
    return [len(r) for r in stage_ranges(n_layer, pp)]


def _model_cfg(model_cfg, n_layer: int):
    cfg = copy.deepcopy(model_cfg)
    cfg.n_layer = n_layer
    return cfg


def mesh_plan(recipe, strategy: Strategy) -> dict:
    """The recipe's plan on the ``(dp, tp)`` mesh with the strategy's per-op overrides first (first match wins)."""
    base = recipe.mesh_plan(bool(strategy.sequence_parallel))
    return {**strategy.op_overrides(), **{k: v for k, v in base.items() if k not in dict(strategy.ops)}}


def stage_spec(recipe, cfg, strategy: Strategy, stage: int, blocks: int | None = None, zero=None) -> StageSpec:
    """``StageSpec`` of stage ``stage`` (``blocks``: repeated layers on it, default the uniform split's)."""
    pp = strategy.pp
    n_layer = int(cfg.model.n_layer)
    counts = stage_layers(n_layer, pp)
    if blocks is not None:  # a shallower model with ``blocks`` layers here and one on every other stage
        counts = [1] * pp
        counts[stage] = blocks
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    model_cfg = _model_cfg(cfg.model, start)
    first, last = stage == 0, stage == pp - 1
    rows, seq = strategy.micro_batch_size * strategy.dp, int(cfg.data.seq_len)
    m = strategy.micro_batches(int(cfg.trainer.global_batch_size))

    def build(placement):
        torch.manual_seed(int(cfg.trainer.seed))
        model = recipe.build_model(model_cfg)
        names = tuple({n for n, _ in model.named_parameters(remove_duplicate=False)}
                      | {n for n, _ in model.named_modules()})
        module = keep_stage(model, recipe.pipeline, ranges, stage)
        plan = plan_for_module(module, mesh_plan(recipe, strategy), names)
        if strategy.zero and strategy.dp > 1:
            if zero is None:
                raise ValueError(f"strategy {strategy.name} uses ZeRO: pass recipes.zero.apply_zero as zero=")
            module, z = zero(module, placement, plan, stage=strategy.zero, dp_axis=0)
            optimizer = build_optimizer(module, cfg.trainer)
            z.attach(optimizer)
        else:
            sc.distribute_module(module, placement, plan)
            optimizer = build_optimizer(module, cfg.trainer)
        return module, optimizer

    def inputs(placement):
        ids = global_input((rows, seq), torch.int64, placement, recipe.data_sbp)
        x = ids if first else global_input((rows, seq, recipe.hidden_size(cfg.model)), torch.float32, placement,
                                           recipe.act_sbp, requires_grad=True)
        return x, (ids if last else None)

    return StageSpec(dp=strategy.dp, tp=strategy.tp, first=first, last=last, build=build, inputs=inputs,
                     forward=recipe.stage_forward, act_sbp=tuple(recipe.act_sbp), micro_batches=m,
                     grad_clip=float(cfg.trainer.grad_clip) or None)
