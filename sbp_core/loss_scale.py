"""Dynamic loss scaling for fp16 training, with the skip decided once for the whole job.

fp16 gradients underflow unless the loss is multiplied by a large scale
before backward; the scale must then come off the gradients before the
optimizer, and a step whose gradients overflowed (inf or NaN anywhere) must
be skipped and the scale lowered. :class:`LossScaler` does what
``torch.amp.GradScaler`` does (initial scale 2**16, x0.5 on an overflow,
x2 after 2000 clean steps in a row) for global-tensor gradients, with the
scale and its growth tracker on the device (``torch._amp_update_scale_``,
GradScaler's kernel), so nothing of it needs the host:

- ``factor(loss)``: the scale where ``loss`` lives (a ``B`` global tensor
  for a global loss), to multiply the loss by before backward;
- ``found_inf(params, stages)`` multiplies every gradient by ``1/scale`` in
  place (``torch._amp_foreach_non_finite_check_and_unscale_`` on the locals,
  the kernel GradScaler uses; a sparse gradient's values likewise) and
  returns a 0-d float tensor on the device, 1 where any element of any
  gradient on any rank is not finite. Each rank's flag is a 0-d global
  tensor ``P(max)`` on every axis of its stage's placement (a gradient split
  or replicated there overflows somewhere if some local does); boxing it to
  ``B`` takes the maximum over the stage (a ``P(max) -> B`` all-reduce), and
  ``grad_clip.across_stages`` over every pipeline stage. So every rank of
  the job gets the same answer and skips the same steps. ``unscale_`` is
  the same with the answer read on the host (a bool).
- ``update(found)`` moves the scale (``found``: that tensor, or a bool).
- ``skips_on_device(optimizer)``: whether the optimizer can take the flag
  itself (a fused torch optimizer reads ``found_inf`` and leaves its
  parameters and state as they were), so the step needs no host read.

Communication: one scalar all-reduce per stage and one scalar exchange
between stages per step. ``scale`` and ``state_dict`` read the device.
"""
from __future__ import annotations

import torch

from .global_tensor import GlobalTensor
from .grad_clip import across_stages
from .layout import Layout
from .sbp import Broadcast, Partial


def skips_on_device(optimizer) -> bool:
    """Can ``optimizer.step()`` skip an overflowed step by itself, given ``optimizer.found_inf`` (a device flag)?
    Torch's fused optimizers can (GradScaler hands them the flag the same way)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups)


class LossScaler:
    """GradScaler's dynamic loss scale for global tensors; ``state_dict`` holds the scale and the growth tracker."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"loss scale: init_scale={init_scale} (> 0), growth_factor={growth_factor} (> 1), "
                             f"backoff_factor={backoff_factor} (in (0, 1)), growth_interval={growth_interval} (>= 1)")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        # GradScaler's state and dtypes; on the gradients' device once one is seen (``_on``).
        self._scale = torch.full((), float(init_scale), dtype=torch.float32)
        self._tracker = torch.zeros((), dtype=torch.int32)

    @property
    def scale(self) -> float:
        """The current scale, read from the device (the host waits: for logs and checkpoints only)."""
        return float(self._scale)

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the scale last moved, read from the device."""
        return int(self._tracker)

    def _on(self, device) -> torch.Tensor:
        """The scale on ``device`` (the tracker follows it: one device per rank)."""
        if self._scale.device != torch.device(device):
            self._scale, self._tracker = self._scale.to(device), self._tracker.to(device)
        return self._scale

    def factor(self, loss):
        """The scale to multiply ``loss`` by: a plain 0-d tensor on its device, or ``B`` on its placement."""
        if isinstance(loss, GlobalTensor):
            scale = self._on(loss._local.device)
            return GlobalTensor(scale, Layout(loss.placement, tuple(Broadcast() for _ in loss.placement.shape),
                                              torch.Size(), torch.float32))
        return self._on(loss.device)

    @torch.no_grad()
    def found_inf(self, params, stages=None) -> torch.Tensor:
        """Divide every gradient of ``params`` by the scale in place; a 0-d float on the device, 1 where any,
        on any rank, is not finite (0 else).

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
            inv = self._on(device).reciprocal()  # the scale is a power of two: exact
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found = flag if found is None else torch.maximum(found, flag.to(found.device))
        flag = GlobalTensor(found, Layout(home, tuple(Partial("max") for _ in home.shape), torch.Size(),
                                          torch.float32))
        flag = flag.to_global(sbp=tuple(Broadcast() for _ in home.shape))
        if stages is not None and len(stages) > 1:
            flag = across_stages(flag, list(stages), float("inf"))
        return flag.to_local()

    def unscale_(self, params, stages=None) -> bool:
        """``found_inf`` read on the host."""
        return bool(self.found_inf(params, stages).item())

    def update(self, found) -> None:
        """GradScaler's rule (its kernel): back off on an overflow, grow after ``growth_interval`` clean steps.
        ``found``: ``found_inf``'s flag, or a bool."""
        if isinstance(found, torch.Tensor):
            found = found.to(self._scale.device, torch.float32)
        else:
            found = torch.full((), float(bool(found)), dtype=torch.float32, device=self._scale.device)
        torch._amp_update_scale_(self._scale, self._tracker, found, self.growth_factor, self.backoff_factor,
                                 self.growth_interval)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = torch.full((), float(state["scale"]), dtype=torch.float32, device=self._scale.device)
        self._tracker = torch.full((), int(state["growth_tracker"]), dtype=torch.int32, device=self._scale.device)
