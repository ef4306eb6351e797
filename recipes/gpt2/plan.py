"""GPT-2's parallel plan as data: Megatron's layout in SBP terms, and the pipeline split.

On a stage's ``(dp, tp)`` mesh (docs/design.md: every stage is the ``(D, T)``
mesh of its ranks) parameters are ``B`` on the dp axis and, on the tp axis:
qkv and fc weights column-split ``S(1)`` (their biases ``S(0)``),
projections row-split ``S(0)``, the token embedding and the LM head
vocabulary-split ``S(0)`` (vocab-parallel embedding and loss), everything
else ``B``. Activations: ``S(0)`` batch on dp, and ``B`` on tp at LayerNorm
inputs (Megatron keeps the residual stream whole), or ``S(1)`` there with
``sequence_parallel``. Dropout and LayerNorm need no entry: their layouts
follow from their inputs.
"""
from __future__ import annotations

from sbp_core.sbp import Broadcast, Split

B, S0, S1 = Broadcast(), Split(0), Split(1)

# tp-axis SBP of each parameter pattern (first match wins); B elsewhere.
TENSOR_PARALLEL = {
    "*.attn.c_attn.weight": S1, "*.attn.c_attn.bias": S0, "*.attn.c_proj.weight": S0,
    "*.mlp.c_fc.weight": S1, "*.mlp.c_fc.bias": S0, "*.mlp.c_proj.weight": S0,
    "transformer.wte.weight": S0, "lm_head.weight": S0,
}
RESIDUAL_WHOLE = {"*.ln_1:input": B, "*.ln_2:input": B, "transformer.ln_f:input": B}
SEQUENCE_PARALLEL = {"*.ln_1:input": S1, "*.ln_2:input": S1, "transformer.ln_f:input": S1}

PIPELINE = {"layers": "transformer.h", "first": ["transformer.wte", "transformer.wpe"], "last": ["transformer.ln_f", "lm_head"]}
TIED = [("transformer.wte.weight", "lm_head.weight")]

# Data and stage-boundary activations on the (dp, tp) mesh.
DATA_SBP = (S0, B)
ACT_SBP = (S0, B)


def mesh_plan(sequence_parallel: bool = False) -> dict:
    """The plan on a ``(dp, tp)`` mesh: parameters ``(B, tp SBP)``; activation pins ``(S(0), tp SBP)`` (batch split over dp)."""
    pins = SEQUENCE_PARALLEL if sequence_parallel else RESIDUAL_WHOLE
    return {**{k: (B, v) for k, v in TENSOR_PARALLEL.items()}, **{k: (S0, v) for k, v in pins.items()}}


def stage_forward(module, x, labels=None):
    """A stage's step: the loss on the last stage (``labels`` given), its output hidden states before.

    ``x``: ``{"input_ids": ...}`` on the first stage, else the hidden states;
    ``labels``: ``{"input_ids": ...}`` (GPT-2 shifts them) on the last stage.
    """
    if isinstance(x, dict):
        x = x["input_ids"]
    if isinstance(labels, dict):
        labels = labels["input_ids"]
    out, loss = module(x, labels)
    return out if labels is None else loss
