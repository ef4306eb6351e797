"""Our cost per op on global tensors, measured on the searched model: its ``device.dispatch_us``.

The cost model charges a dispatched stage ``host_overhead`` seconds per op
on global tensors on top of its kernels (``toolkit.search.costmodel``).
``scripts/calibrate_machine.py`` fits that figure together with the kernel
factor on two small calibration GPT-2s (13.9 us in this machine's cluster
file). What an op costs beyond its kernel inside a training step — the
dispatcher, the global tensor's autograd node, the boxing's Python around
a collective, the local views and copies a decomposition adds — depends on
the model's ops: gpt2-tiny's tensor-parallel stages took 25-70% more CPU
than their priced kernels and dispatch (``scripts/verify_simulator.py``).

``model_host_costs`` measures it on the model being searched, together
with the kernel factor (``kernel_factor``), in one loop: one micro-batch's
forward and backward of the whole model under a two-device layout (tensor
parallel; data parallel where the model allows no tp2), run for real on
rank 0 of a fake world (``toolkit.search.rehearsal.fake_world``:
collectives return at once, so the CPU time is this rank's own work),
alternating with the kernel factor's plain one-device step, one intra-op
thread, the runtime's host-memory policy, best of ``repeats`` each. The
dispatch cost is that forward and backward's CPU minus the same phases'
rehearsed calls priced at the kernel factor, over the global ops the
rehearsal counted in them. Alternating matters: it is a difference of two
timings, and this VM's speed drifts by 20% within seconds (measured one
after the other, the factor came out 0.83 with 105-150 us, then 1.01 with
43-64 us). No layout's step time enters either figure. Batch fields are
synthetic (floats random, integers zero).
"""
from __future__ import annotations

import torch

from .kernel_factor import cpu_seconds, fill_synthetic, plain_step, rehearsed_kernel_seconds


def _two_device_strategy(model, rows: int):
    from toolkit.search.strategy import Strategy

    for s in (Strategy(tp=2, micro_batch_size=rows), Strategy(dp=2, micro_batch_size=rows)):
        if not model.problems(s):
            return s
    raise ValueError(f"{model.recipe.name}: neither tp2 nor dp2 is a valid layout, so its dispatch cost cannot "
                     f"be measured on two devices")


def _forward_backward(model, strategy):
    """A closure running one micro-batch's forward and backward of ``strategy``'s one stage (inside a fake world)."""
    from sbp_core.module import defer_grad_boxing
    from sbp_core.placement import placement as make_placement

    from .stage_spec import stage_spec

    spec = stage_spec(model.recipe, model.cfg, strategy, 0)
    mesh = [[d * strategy.tp + t for t in range(strategy.tp)] for d in range(strategy.dp)]
    placement = make_placement(spec.device_type, mesh)
    module, _, _ = spec.build(placement)
    x, labels = spec.inputs(placement)
    fill_synthetic(x)
    fill_synthetic(labels)

    def forward_backward():
        with defer_grad_boxing():
            spec.forward(module, x, labels).backward()
        for p in module.parameters():
            p.grad = None

    forward_backward()
    return forward_backward


def model_host_costs(model, costs, rows: int, repeats: int = 10) -> tuple:
    """``(kernel factor, seconds per global op beyond its kernel)`` for ``model`` (a ``RecipeSearchModel``) with
    ``rows`` rows per micro-batch, measured as the module docstring says."""
    from runtime.host_memory import keep_freed_host_memory
    from toolkit.search.rehearsal import OpCall, fake_world
    from toolkit.search.strategy import Strategy

    strategy = _two_device_strategy(model, rows)  # one stage: the whole model
    plain_kernels = rehearsed_kernel_seconds(model, Strategy(micro_batch_size=rows), costs)
    phases = [model.trace(strategy, 0).phases[name] for name in ("F", "B0")]
    kernels = sum(costs.seconds(e) for ph in phases for e in ph.events if isinstance(e, OpCall))
    ops = sum(len(ph.global_ops) for ph in phases)
    keep_freed_host_memory()  # as a training rank's host memory (fresh pages for each big tensor cost 2-3x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fake_world(strategy.world):
            step, forward_backward = plain_step(model.recipe, model.cfg, rows), _forward_backward(model, strategy)
            plain = dispatched = float("inf")
            for _ in range(repeats):
                plain = min(plain, cpu_seconds(step))
                dispatched = min(dispatched, cpu_seconds(forward_backward))
    finally:
        torch.set_num_threads(threads)
    factor = plain / plain_kernels
    return factor, max(0.0, dispatched - factor * kernels) / ops
