"""ZeRO (stages 0-3) as an SBP rewrite: masters ``S(d)`` on the data-parallel axis, one cast to ``B``.

``plan.py`` rewrites a parallel plan's layouts into the masters' layouts;
``apply.py`` holds masters, compute copies and gradients and runs the
optimizer-step protocol; ``sbp_core.cast`` is the differentiable cast whose
boxing all-gathers in forward and reduce-scatters in backward (coalesced over
many tensors, rematerialised for stage 3); ``accounting.py`` measures memory
against the ZeRO paper's formulas.

Trainer protocol (one call per pipeline-stage module, on that stage's placement)::

    model, zero = apply_zero(model, placement, plan, stage=2, dp_axis=0,
                             compute_dtype=torch.bfloat16)       # or None: fp32 compute
    opt = zero.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for step in ...:
        for micro in batches:                    # stages 0-1: all but the last inside sc.defer_grad_boxing()
            model(x, y)[1].backward()            # (one reduction per step, in buckets overlapping the last backward)
        zero.sync_grads()                        # masters' .grad: S(d), fp32
        norm = sc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()                               # pre-hook: sync_grads (no-op now); post-hook: refresh()
        opt.zero_grad()                          #   re-gathers the compute copies (stages 0-2)

``model.parameters()`` / ``state_dict()`` are the fp32 masters (``S(d)`` on
the dp axis); after loading them call ``zero.refresh()``. Several stage
modules on one rank: build one optimizer over
``[local for z in zeros for _, local in z.shard_pairs()]`` and call
``z.attach(opt, z.shard_pairs())`` for each ``z``.
"""
from .accounting import formula_bytes, held_bytes, model_elements, traffic_formula
from .apply import Zero, apply_zero
from .plan import VALID_STAGES, check_stage, master_sbp, rewrite_plan

__all__ = ["apply_zero", "Zero", "VALID_STAGES", "check_stage", "master_sbp", "rewrite_plan",
           "held_bytes", "model_elements", "formula_bytes", "traffic_formula"]
