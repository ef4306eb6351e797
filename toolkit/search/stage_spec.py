"""A recipe's pipeline stage under a ``Strategy``, as ``toolkit.search`` rehearses it.

Builds what the trainer builds (``toolkit.trainer.Job``) for one stage: the
full model from the recipe, only this stage's layers and first/last modules,
the recipe's plan with the strategy's per-op layouts first
(``toolkit.mesh.with_overrides``, as ``parallel.plan`` does in training),
ZeRO's rewrite or ``distribute_module``, the recipe's optimizer, and one
micro-batch's global inputs (the ``inputs`` fields on the first stage, the
boundary activation elsewhere, the ``labels`` fields on the last);
activation checkpointing and bf16 autocast as the trainer applies them.
``layers`` keeps other repeated layers than the uniform split's, so that a
deep stage can be priced from shallow rehearsals
(``toolkit.search.search_model``).
"""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

import sbp_core as sc
from toolkit.search.stage_trace import StageSpec, global_input
from toolkit.search.strategy import Strategy
from toolkit.config import typed
from toolkit.mesh import model_names, plan_for_module, with_overrides
from toolkit.recipe import data_shard, recipe_batch
from toolkit.stages import boundary_specs, keep_layers, stage_ranges
from toolkit.trainer import AUTOCAST, autocast_forward
from toolkit.zero import apply_zero


def strategy_cfg(cfg, recipe, strategy: Strategy):
    """A typed copy of ``cfg`` that runs ``strategy`` (degrees, ZeRO, micro-batch, sequence parallel, per-op plan)."""
    out = typed(OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg, recipe)
    par = out.parallel
    par.dp, par.tp, par.pp, par.zero = strategy.dp, strategy.tp, strategy.pp, strategy.zero
    par.sequence_parallel, par.plan, par.stage_layers = strategy.sequence_parallel, dict(strategy.ops), None
    par.pp_schedule, par.pp_virtual = strategy.schedule, strategy.virtual
    par.auto = False
    out.trainer.micro_batch_size = strategy.micro_batch_size
    return out


def stage_layers(recipe, cfg, stages: int, stage: int) -> range:
    """The repeated layers of stage ``stage`` of ``stages`` (the uniform split)."""
    if recipe.pipeline_plan(cfg.model) is None:
        return range(0)
    return stage_ranges(recipe.n_layers(cfg.model), stages)[stage]


def stage_spec(recipe, cfg, strategy: Strategy, stage: int, layers=None) -> StageSpec:
    """``StageSpec`` of stage ``stage`` (``layers``: the repeated layers it holds, default the uniform split's)."""
    cfg = strategy_cfg(cfg, recipe, strategy)
    n = strategy.stages
    layers = stage_layers(recipe, cfg, n, stage) if layers is None else layers
    first, last = stage == 0, stage == n - 1
    split = recipe.pipeline_plan(cfg.model)
    mesh_shape, origin = (strategy.dp, strategy.tp), (0, 0)
    rows = strategy.micro_batch_size * data_shard(recipe.data_sbp, mesh_shape, origin)[1]
    fields = recipe_batch(cfg, recipe)

    def build(placement):
        torch.manual_seed(int(cfg.trainer.seed))
        model = recipe.build_model(cfg.model)
        names = model_names(model)
        module = model if split is None else keep_layers(model, split, layers, first, last)
        if cfg.trainer.activation_checkpointing:
            recipe.checkpoint_layers(module, cfg.model)
        plan = plan_for_module(module, with_overrides(recipe.mesh_plan(cfg), cfg.parallel.plan), names)
        z = None
        if strategy.zero and strategy.dp > 1:
            module, z = apply_zero(module, placement, plan, stage=strategy.zero, dp_axis=0)
            optimizer = recipe.build_optimizer(module, cfg)  # no ZeRO hooks: the step refreshes, as the trainer's
        else:
            sc.distribute_module(module, placement, plan)
            optimizer = recipe.build_optimizer(module, cfg)
        return module, optimizer, z

    def batch(placement, names):
        return {k: global_input((rows, *fields[k][0]), fields[k][1], placement, recipe.data_sbp) for k in names}

    acts = None
    if not first:  # what the stages before send: the model up to this stage's first layer, run on meta tensors
        acts = boundary_specs(lambda: recipe.build_model(cfg.model), recipe.stage_forward, split,
                              [range(0, layers.start), range(layers.start, recipe.n_layers(cfg.model))],
                              {k: ((rows, *fields[k][0]), fields[k][1]) for k in recipe.inputs}, recipe.inputs)[0]

    def inputs(placement):
        if first:
            x = batch(placement, recipe.inputs)
        else:
            x = tuple(global_input(shape, dtype, placement, recipe.act_sbp, requires_grad=dtype.is_floating_point)
                      for shape, dtype in acts)
            x = x[0] if len(x) == 1 else x
        return x, (batch(placement, recipe.labels) if last else None)

    m = int(cfg.trainer.global_batch_size) // rows
    forward = recipe.stage_forward
    if cfg.trainer.precision != "fp32":  # the rehearsal's tensors are (fake) CPU tensors
        forward = autocast_forward(forward, "cpu", AUTOCAST[cfg.trainer.precision])
    return StageSpec(dp=strategy.dp, tp=strategy.tp, first=first, last=last, build=build, inputs=inputs,
                     forward=forward, act_sbp=tuple(recipe.act_sbp), micro_batches=m,
                     grad_clip=float(cfg.trainer.grad_clip) or None, rows_weigh_equally=recipe.rows_weigh_equally)


def mesh_plan(recipe, cfg, strategy: Strategy) -> dict:
    """The plan a stage of ``strategy`` is distributed with (recipe's plan, per-op layouts first)."""
    c = strategy_cfg(cfg, recipe, strategy)
    return with_overrides(recipe.mesh_plan(c), c.parallel.plan)
