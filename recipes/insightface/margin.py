"""Additive angular / cosine margins on the target logit (InsightFace's CombinedMarginLoss), plain torch.

For a target cosine ``t = cos(theta)`` the margin logit is
``cos(m1 * theta + m2) - m3``:

- ArcFace ``(m1, m2, m3) = (1, 0.5, 0)``: ``t cos m2 - sqrt(1 - t^2) sin m2``;
  where ``theta + m2`` would pass ``pi`` (``t <= cos(pi - m2)``) the logit
  continues linearly as ``t - m2 sin(pi - m2)`` so it keeps decreasing in
  ``theta`` (InsightFace's non-easy margin);
- CosFace ``(1, 0, 0.4)``: ``t - m3``;
- anything else: ``cos(m1 * acos(t) + m2) - m3``.

``sin`` and ``acos`` see ``t`` clamped into ``[-1 + 1e-7, 1 - 1e-7]`` so
their gradients stay finite at ``|t| = 1``. Unlike InsightFace's
``torch.no_grad`` ArcFace shortcut, gradients flow through the margin
exactly (the single-device reference and every layout compute one function).

``CombinedMargin`` is a module of its own so a plan can lay out its input:
only the ``[N, 1]`` target cosines pass through it (the head replaces the
target logits with its output, then scales every logit by ``s``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

STANDARD = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.0, 0.3, 0.2)}
_EDGE = 1e-7


class CombinedMargin(nn.Module):
    def __init__(self, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0, s: float = 64.0):
        super().__init__()
        self.m1, self.m2, self.m3, self.s = float(m1), float(m2), float(m3), float(s)

    @classmethod
    def named(cls, loss: str, s: float = 64.0, margins=None) -> "CombinedMargin":
        """``loss`` in ``arcface|cosface|combined``; ``margins`` ``(m1, m2, m3)`` overrides its standard ones."""
        if loss not in STANDARD:
            raise ValueError(f"loss {loss!r} is unknown; valid: {', '.join(STANDARD)}")
        m1, m2, m3 = STANDARD[loss] if margins is None else margins
        return cls(m1, m2, m3, s)

    def extra_repr(self) -> str:
        return f"m1={self.m1}, m2={self.m2}, m3={self.m3}, s={self.s}"

    def forward(self, t):
        """The margin logit for target cosines ``t`` (any shape, values in ``[-1, 1]``), before scaling."""
        m1, m2, m3 = self.m1, self.m2, self.m3
        if m1 == 1.0 and m2 == 0.0:
            return t - m3
        edge = t.clamp(-1.0 + _EDGE, 1.0 - _EDGE)
        if m1 == 1.0 and m3 == 0.0:
            arc = t * math.cos(m2) - (1.0 - edge * edge).sqrt() * math.sin(m2)
            return torch.where(t > math.cos(math.pi - m2), arc, t - m2 * math.sin(math.pi - m2))
        return (m1 * edge.acos() + m2).cos() - m3
