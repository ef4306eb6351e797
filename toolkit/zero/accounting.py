"""Per-rank memory of parameters, gradients and optimizer states, measured and by the ZeRO paper.

``held_bytes`` counts what this rank holds: every distinct storage behind the
local tensors of the compute copies (or shards), the gradients, the masters
and the optimizer's state, each once, in the first of those categories it
appears in (a fp32 master that is a view of its compute copy is counted with
the parameters). 0-d optimizer state (Adam's step counter) is not counted.

``formula_bytes`` is the ZeRO paper's (Rajbhandari et al., 2020, section 5)
with ``Ψ`` parameters on this rank's model-parallel shard and ``N``
data-parallel ranks. Mixed precision (bf16 compute copies, fp32 masters):
parameters 2Ψ, gradients 2Ψ, optimizer states KΨ with K = 12 (fp32 master,
Adam's two moments); stage 1 divides the states by N, stage 2 also the
gradients, stage 3 also the parameters. In fp32 the parameter is its own
master: 4Ψ, 4Ψ and K = 8.

``traffic_formula``: bytes this rank sends per step, with the ledger's
convention (an all-gather or reduce-scatter sends ``(N-1)/N`` of the
tensor; ring all-reduce twice that): ``2Ψ`` for stages 0-2 and ``3Ψ`` for
stage 3, in compute-dtype bytes, each times ``(N-1)/N``.
"""
from __future__ import annotations

import torch


def _locals(tensors):
    for t in tensors:
        if t is None:
            continue
        local = t._local if isinstance(t, torch.Tensor) and hasattr(t, "_local") else t
        if hasattr(local, "to_local"):  # a DTensor (peers measured the same way)
            local = local.to_local()
        if local.numel():
            yield local


def _count(tensors, seen: set) -> int:
    total = 0
    for local in _locals(tensors):
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state(optimizer) -> list:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def count_bytes(params, grads, states) -> dict:
    """Distinct storage bytes of ``params``, then ``grads``, then ``states`` (each storage once)."""
    seen: set = set()
    out = {"params": _count(params, seen), "grads": _count(grads, seen), "optimizer_states": _count(states, seen)}
    out["total"] = sum(out.values())
    return out


def held_bytes(zero, optimizer=None) -> dict:
    """This rank's bytes of parameters, gradients and optimizer states under ``zero``."""
    if not zero.slots:
        params = list(zero.module.parameters())
        return count_bytes(params, [p.grad for p in params], optimizer_state(optimizer))
    leaves = [s.leaf for s in zero.slots]
    masters = [s.master for s in zero.slots]
    grads = [t for s in zero.slots for t in (s.leaf.grad, s.grad, s.master.grad)]
    return count_bytes(leaves, grads, masters + optimizer_state(optimizer))


def model_elements(zero) -> int:
    """Ψ: elements of this rank's compute copies (its model-parallel shard of the model), tied ones once."""
    from sbp_core.layout import Layout
    from sbp_core.process_groups import world_rank

    if not zero.slots:
        return sum(q._local.numel() for q in zero.module.parameters())
    me = world_rank()
    return sum(Layout(s.master.placement, s.compute_sbp, s.master.shape, s.master.dtype).local_shape(me).numel()
               for s in zero.slots)


def formula_bytes(stage: int, psi: int, n: int, mixed: bool) -> dict:
    """The ZeRO paper's per-rank bytes of parameters, gradients and optimizer states."""
    b, k = (2, 12) if mixed else (4, 8)
    out = {"params": b * psi / (n if stage >= 3 else 1),
           "grads": b * psi / (n if stage >= 2 else 1),
           "optimizer_states": k * psi / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def traffic_formula(stage: int, psi: int, n: int, mixed: bool) -> float:
    """Bytes this rank sends per step for data parallelism: ``2Ψ`` (stages 0-2) or ``3Ψ`` (stage 3)."""
    return (3 if stage == 3 else 2) * psi * (2 if mixed else 4) * (n - 1) / n
