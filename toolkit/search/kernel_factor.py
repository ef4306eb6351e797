"""How long the searched model's kernels take inside a step against measured one by one.

``MeasuredOpCosts`` times each distinct local call alone, on freshly made
tensors, and the cost model multiplies those seconds by the cluster's
``device.kernel_factor``. ``scripts/calibrate_machine.py`` fits that factor
on two small calibration GPT-2s; on gpt2-tiny the calls timed alone summed
to 1.25-4x what the same phases took inside a real step, so every layout
whose stages run on plain tensors was over-predicted by 27-55% with the
calibration models' factor. This module measures the factor on the model
being searched instead: one plain one-device training step of a
micro-batch (forward, backward, the recipe's optimizer step; one intra-op
thread, best of several by process CPU time — what the runtime's one-device
and audited data-parallel stages run; ``plain_step``) over the summed
measured seconds of the same step's rehearsed calls (``F``, ``B0`` and
``update`` of the one-device strategy; ``rehearsed_kernel_seconds``).
``dispatch_cost.model_host_costs`` takes both timings, alternating with
the model's dispatch cost. No layout's step time enters it.

Batch fields are synthetic: floats random, integers zero (a valid index for
every embedding and class), as ``MeasuredOpCosts`` makes its inputs.
"""
from __future__ import annotations

import time

import torch


def _batch(recipe, cfg, rows: int) -> dict:
    out = {name: torch.empty((rows, *shape), dtype=dtype) for name, (shape, dtype) in recipe.batch_fields(cfg).items()}
    fill_synthetic(out)
    return out


def fill_synthetic(fields) -> None:
    """Fill a dict of tensors (plain, or global: their locals) in place: floats random, integers zero."""
    from sbp_core.global_tensor import GlobalTensor

    with torch.no_grad():
        for t in (fields or {}).values():
            local = t._local if isinstance(t, GlobalTensor) else t
            local.normal_() if local.is_floating_point() else local.zero_()


def plain_step(recipe, cfg, rows: int):
    """A closure running one plain one-device training step of ``rows`` rows (forward, backward, the recipe's
    optimizer step), run once already so that the optimizer's state exists, as in the rehearsal's priced step."""
    torch.manual_seed(0)
    module = recipe.build_model(cfg.model)
    if any(p.is_meta for p in module.parameters()):
        # Built on the meta device for distribute_module to fill shard by shard (Wide&Deep's tables):
        # the timing needs values, not the recipe's initialisation.
        module.to_empty(device="cpu")
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02)
    opt = recipe.build_optimizer(module, cfg)
    batch = _batch(recipe, cfg, rows)
    x = {k: batch[k] for k in recipe.inputs}
    labels = {k: batch[k] for k in recipe.labels}

    def step():
        recipe.stage_forward(module, x, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


def cpu_seconds(fn) -> float:
    """Process CPU seconds of one call of ``fn``."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def rehearsed_kernel_seconds(model, strategy, costs) -> float:
    """Summed measured seconds of the calls a one-device step of one micro-batch makes (``F + B0 + update``)."""
    from toolkit.search.rehearsal import OpCall

    trace = model.trace(strategy, 0)
    return sum(costs.seconds(e) for name in ("F", "B0", "update") for e in trace.phases[name].events
               if isinstance(e, OpCall))
