"""Dynamic loss scaling for fp16 training, with the skip decided once for the whole job.

fp16 gradients underflow unless the loss is multiplied by a large scale
before backward; the scale must then come off the gradients before the
optimizer, and a step whose gradients overflowed (inf or NaN anywhere) must
be skipped and the scale lowered. :class:`LossScaler` does what
``torch.amp.GradScaler`` does (initial scale 2**16, x0.5 on an overflow,
x2 after 2000 clean steps in a row) for global-tensor gradients:

- ``unscale_(params, stages)`` multiplies every gradient by ``1/scale`` in
  place (``torch._amp_foreach_non_finite_check_and_unscale_`` on the locals,
  the kernel GradScaler uses; a sparse gradient's values likewise) and
  returns whether any element of any gradient on any rank is not finite.
  Each rank's flag is a 0-d global tensor ``P(max)`` on every axis of its
  stage's placement (a gradient split or replicated there overflows
  somewhere if some local does); boxing it to ``B`` takes the maximum over
  the stage (a ``P(max) -> B`` all-reduce), and ``grad_clip.across_stages``
  over every pipeline stage. So every rank of the job gets the same answer
  and skips the same steps.
- ``update(found_inf)`` moves the scale; the scale is a Python float, the
  same on every rank because the flag is.

Communication: one scalar all-reduce per stage and one scalar exchange
between stages per step. The flag is read on the host (as GradScaler's
``step`` does) to decide the skip.
"""
from __future__ import annotations

import torch

from .global_tensor import GlobalTensor
from .grad_clip import across_stages
from .layout import Layout
from .sbp import Broadcast, Partial


class LossScaler:
    """GradScaler's dynamic loss scale for global tensors; ``state_dict`` holds the scale and the growth tracker."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"loss scale: init_scale={init_scale} (> 0), growth_factor={growth_factor} (> 1), "
                             f"backoff_factor={backoff_factor} (in (0, 1)), growth_interval={growth_interval} (>= 1)")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    @torch.no_grad()
    def unscale_(self, params, stages=None) -> bool:
        """Divide every gradient of ``params`` by the scale in place; whether any, on any rank, is not finite.

        ``params``: this rank's parameters (its stage's, in a pipeline); ``stages``: every stage's
        placement, so the answer spans them. Every rank of every stage calls this.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            raise ValueError("unscale_ got no parameter with a gradient")
        home = grads[0].placement
        locals_: dict = {}
        for g in grads:
            if not isinstance(g, GlobalTensor) or g.placement != home:
                raise ValueError(f"unscale_ needs global gradients on one placement (a stage's); got {type(g).__name__} "
                                 f"on {getattr(g, 'placement', None)} and {home}")
            local = g._local._values() if g.is_sparse else g._local
            locals_.setdefault((local.device, local.dtype), []).append(local)  # GradScaler's grouping
        found = None
        for (device, _), tensors in locals_.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found = flag if found is None else torch.maximum(found, flag.to(found.device))
        flag = GlobalTensor(found, Layout(home, tuple(Partial("max") for _ in home.shape), torch.Size(),
                                          torch.float32))
        flag = flag.to_global(sbp=tuple(Broadcast() for _ in home.shape))
        if stages is not None and len(stages) > 1:
            flag = across_stages(flag, list(stages), float("inf"))
        return bool(flag.to_local().item())

    def update(self, found_inf: bool) -> None:
        """GradScaler's rule: back off on an overflow, grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
