"""LLaMA's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``: a dense layer's MLP, and Qwen2-MoE's shared expert."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``[..., hidden] -> [..., hidden]`` through ``intermediate`` columns (``gate_proj``, ``up_proj``,
    ``down_proj``: Hugging Face's names and ``[out, in]`` shapes, no biases)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
