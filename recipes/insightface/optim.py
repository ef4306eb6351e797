"""SGD for Partial FC: the class centres update only the rows sampled since the last step.

``PartialFCSGD(params, sampled_rows={weight: head.sampled_rows}, lr=..., momentum=..., weight_decay=...)``
is ``torch.optim.SGD`` (no dampening, no Nesterov) for every parameter, except
that for a parameter listed in ``sampled_rows`` whose callable returns
``(rows, kept)`` (local row indices of its local shard, its global tensor's
shard or the whole tensor on one device, which may repeat; and whether each
is in the sample), only the rows kept take the step: their weight decay,
momentum buffer and update. The step gathers ``rows``, updates the kept ones
and writes all back (a repeated row writes the same values each time), so
neither is read on the host and the work is that of the rows alone.
Un-sampled rows, and their momentum, stay exactly as they were (Partial FC
keeps every centre but trains only the sampled ones); ``zero_grad`` forgets
the rows sampled since the last step, so a skipped step's sample does not
move in the next. A callable returning
``None`` means every row (no sampling): plain SGD.

The momentum buffer of a sampled parameter is a tensor of the parameter's
layout stored under torch's key ``momentum_buffer``, so checkpoints
(``toolkit.checkpoint.optimizer_state_dict``) and LR schedulers treat it like
any SGD state. Zero-initialised buffers are equivalent to torch's "first
step copies the gradient" (dampening 0).
"""
from __future__ import annotations

import torch

from sbp_core import GlobalTensor


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class PartialFCSGD(torch.optim.SGD):
    #: Its row step reads only the parameter's own rows: ``sbp_core.step_on_locals`` may run it on the
    #: global parameters' locals (no op dispatch; torch's foreach kernels on CUDA).
    elementwise = True

    def __init__(self, params, sampled_rows: dict | None = None, **sgd):
        if sgd.get("nesterov") or sgd.get("dampening", 0):
            raise ValueError("PartialFCSGD supports plain momentum only (nesterov=False, dampening=0)")
        super().__init__(params, **sgd)
        self.sampled_rows = dict(sampled_rows or {})

    def _group_of(self, p) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def _stepped(self, p):
        """The tensor the groups hold for ``p``: ``p``, or its local while ``step_on_locals`` runs the step."""
        held = {id(q) for g in self.param_groups for q in g["params"]}
        return p if id(p) in held or not isinstance(p, GlobalTensor) else p._local

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also forget the rows sampled since the last step: a step skipped (fp16's overflow) must not
        move them in the next, whose sample they may not be in."""
        for rows_of in self.sampled_rows.values():
            rows_of()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        rowwise = []
        for p, rows_of in self.sampled_rows.items():
            p = self._stepped(p)
            sampled = rows_of()
            if sampled is not None and p.grad is not None:
                rowwise.append((p, p.grad, sampled))
                p.grad = None  # torch's SGD skips parameters without a gradient
        loss = super().step(closure)
        for p, grad, sampled in rowwise:
            p.grad = grad
            self._rows_step(p, grad, sampled)
        return loss

    def _rows_step(self, p, grad, sampled) -> None:
        group = self._group_of(p)
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        rows, kept = sampled
        w = _local(p)
        kept = kept.view(-1, *[1] * (w.dim() - 1))  # broadcast over each row
        old = w[rows]
        d = _local(grad)[rows]
        if decay:
            d = d + decay * old
        if momentum:
            state = self.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = _local(state["momentum_buffer"])
            was = buf[rows]
            d = was * momentum + d
            buf[rows] = torch.where(kept, d, was)
        w[rows] = torch.where(kept, old - lr * d, old)
