"""Scaled dot-product attention: one rule for every fused kernel ``F.scaled_dot_product_attention`` reaches.

The kernels, forward and backward:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (no dropout);
- CUDA: ``_scaled_dot_product_flash_attention``,
  ``_scaled_dot_product_efficient_attention`` (takes a mask as
  ``attn_bias``) and ``_scaled_dot_product_cudnn_attention``.

They differ only in argument order and in the small tensors they return
next to the attention (random-number state, cumulative sequence lengths,
debug masks), so the rule reads each tensor's role from the op's schema by
argument name rather than by position:

- activations (``query``, ``key``, ``value``, ``out``, ``grad_out``,
  ``logsumexp``) share one layout: ``S(0)`` (batch: data parallel) or
  ``S(1)`` (heads: tensor parallel; offered only when key and value have as
  many heads as the query); ``B`` -> ``B``;
- a mask (``attn_mask``/``attn_bias``) is split like the activations along
  the dims where it does not broadcast, ``B`` elsewhere;
- everything else (``philox_seed``, ``rng_state``, ``cum_seq_*``) is ``B``.

Outputs: the kernel's first two (the attention and its log-sum-exp) take the
activations' layout, the rest ``B``; a backward's gradients take the
activations' layout. Backward ops also take ``P`` -> ``P`` when the incoming
gradient is partial (they are linear in it). The sequence dim is never
split here: sequence parallelism gathers it before attention (each query
attends to every key), as Megatron does, so an input split on it is boxed.

Dropout inside the kernel draws its mask per shard, which no layout can
make equal to one device's draw: such calls are refused (torch takes the
math path, whose dropout is exact, when the model asks for dropout).
Nothing here communicates except the boxing the dispatcher does.
"""
from __future__ import annotations

import torch

from ..sbp import Split
from .common import B, P
from .registry import Sig, TensorMeta, register

aten = torch.ops.aten

_ACTIVATIONS = {"query", "key", "value", "out", "grad_out", "grad_out_", "logsumexp"}
_MASKS = {"attn_mask", "attn_bias"}

FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)


def _roles(call) -> list:
    """``(name, TensorMeta)`` of each global tensor input, in the order of ``call.metas``."""
    schema = call.func._schema.arguments
    named = [(schema[i].name, a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [(name, a) for name, a in named if isinstance(a, TensorMeta)]


def _mask_sbp(mask, d: int, q):
    """A mask's SBP when the activations are split on dim ``d`` (``B`` where it broadcasts)."""
    k = d - (q.ndim - mask.ndim)
    return Split(k) if k >= 0 and mask.shape[k] == q.shape[d] else B


def _tensor_returns(func) -> int:
    return sum(isinstance(r.type, torch.TensorType) for r in func._schema.returns)


def _refuse_dropout(call) -> None:
    p = call.kwargs.get("dropout_p") if "dropout_p" in call.kwargs else next(
        (a for a, s in zip(call.args, call.func._schema.arguments) if s.name == "dropout_p"), 0.0)
    if p:
        raise ValueError(
            f"{call.func} with dropout_p={p} has no SBP rule (its mask would be drawn per shard); "
            "F.scaled_dot_product_attention with dropout is exact on its math path, which CPU takes by itself; "
            "on CUDA run it under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or set its dropout to 0"
        )


def _refuse_mask_grad(call) -> None:
    mask = dict(zip((s.name for s in call.func._schema.arguments), call.args)).get("grad_input_mask")
    if mask is not None and len(mask) > 3 and mask[3]:
        raise ValueError(
            f"{call.func} asked for the attention bias's gradient, which has no SBP rule "
            "(a bias broadcast over batch or heads would need its gradient summed); "
            "pass a mask that does not require grad"
        )


def _signatures(call, backward: bool) -> list:
    _refuse_dropout(call)
    if backward:
        _refuse_mask_grad(call)
    roles = _roles(call)
    metas = dict(roles)
    q = metas["query"]
    dims = [0] + ([1] if all(metas[n].shape[1] == q.shape[1] for n in ("key", "value")) else [])
    n_out = _tensor_returns(call.func)
    n_act_out = n_out if backward else 2

    def one(d):
        ins = tuple(Split(d) if name in _ACTIVATIONS else _mask_sbp(m, d, q) if name in _MASKS else B
                    for name, m in roles)
        return Sig(ins, (Split(d),) * n_act_out + (B,) * (n_out - n_act_out))

    sigs = [one(d) for d in dims]
    sigs.append(Sig((B,) * len(roles), (B,) * n_out))
    if backward and _partial_grad(call):
        sigs.append(Sig((P,) + (B,) * (len(roles) - 1), (P,) * n_out))
    return sigs


def _partial_grad(call) -> bool:
    s = call.actual(0)
    return s is not None and s.is_partial and s.op == "sum"


@register(*FORWARD)
def attention(call):
    return _signatures(call, backward=False)


@register(*BACKWARD)
def attention_backward(call):
    return _signatures(call, backward=True)
