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
gradient is partial (they are linear in it).

The CPU kernel also takes the queries split on the sequence (``S(2)``, the
context-parallel layout): ``query``, ``out``, ``grad_out`` and
``logsumexp`` ``S(2)``, a mask's query rows split with them, ``key`` and
``value`` ``B`` (each query attends to every key, so they are gathered);
the key and value gradients come back ``P`` (each rank's queries' share of
them). Under ``is_causal`` a rank's queries are not the first positions, so
its local call (``_causal_rows``) attends to the keys up to its last query
with the causal mask moved to its offset, which torch's ``is_causal`` (top
left aligned) cannot say. The CUDA kernels are not offered this split: flash
takes no mask, and their causal alignment for a query block differs by
kernel; there a sequence split is boxed to one they take, as Megatron's
sequence parallelism gathers the sequence before attention.

Dropout inside the kernel draws its mask per shard, which no layout can
make equal to one device's draw: such calls are refused (torch takes the
math path, whose dropout is exact, when the model asks for dropout).
Nothing here communicates except the boxing the dispatcher does.
"""
from __future__ import annotations

import math

import torch

from ..layout import local_box
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


SEQ = 2  # the sequence dim of the kernels' [batch, heads, sequence, head_dim] activations
_KEYS = {"key", "value"}


def _signatures(call, backward: bool, seq_split: bool = False) -> list:
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
    if seq_split:
        sigs.append(_query_rows(roles, q, backward, n_out))
    sigs.append(Sig((B,) * len(roles), (B,) * n_out))
    if backward and _partial_grad(call):
        sigs.append(Sig((P,) + (B,) * (len(roles) - 1), (P,) * n_out))
    return sigs


def _query_rows(roles, q, backward: bool, n_out: int) -> Sig:
    """Queries split on the sequence, keys and values whole: the query-side tensors and outputs ``S(2)``, the
    key and value gradients ``P``."""
    ins = tuple(B if name in _KEYS else Split(SEQ) if name in _ACTIVATIONS else _mask_sbp(m, SEQ, q)
                if name in _MASKS else B for name, m in roles)
    outs = (Split(SEQ), P, P) if backward else (Split(SEQ), Split(SEQ))
    return Sig(ins, outs + (B,) * (n_out - len(outs)))


_NAMES: dict = {}  # kernel -> its argument names


def _causal_rows(func, args, kwargs, ctx):
    """The CPU kernel (forward or backward) on this rank's query rows ``[s, s + n)`` of ``L``.

    Without ``is_causal``, or with the queries whole on the sequence, the call is the kernel's own. Under
    ``is_causal`` with the rows split, queries ``s + i`` attend to keys ``j <= s + i``: the kernel runs on keys
    and values ``[0, s + n)`` with that mask added to the call's own (``is_causal`` off); a backward's key and
    value gradients are padded with zeros past ``s + n`` (this rank's term of their ``P``). A rank holding no
    query (an empty shard) returns empty outputs and zero key and value gradients without calling the kernel,
    which fails on an empty sequence."""
    names = _NAMES.get(func) or _NAMES.setdefault(func, [a.name for a in func._schema.arguments])
    bound = dict(zip(names, args), **kwargs)
    query = bound["query"]
    if query.numel() == 0:
        return tuple(torch.zeros(shape, dtype=lay.dtype, device=query.device)
                     for shape, lay in zip(ctx.local_out_shapes, ctx.out_layouts))
    lay = ctx.in_layouts[1 if "grad_out" in bound else 0]  # the query: the first tensor, after a backward's grad_out
    if not bound.get("is_causal") or not any(s.is_split and s.axis == SEQ for s in lay.sbp):
        return func(*args, **kwargs)
    start, n = local_box(lay.shape, lay.placement.shape, lay.sbp, ctx.coords)[SEQ]
    keys = bound["key"].shape[SEQ]
    seen = min(keys, start + n)
    rows = torch.arange(start, start + n, device=query.device)
    later = torch.arange(seen, device=rows.device)[None, :] > rows[:, None]
    # The kernel takes an additive mask of the query's dtype (not a boolean one).
    mask = torch.zeros(later.shape, dtype=query.dtype, device=rows.device).masked_fill_(later, -math.inf)
    own = bound.get("attn_mask")
    if own is not None:  # the call's own (additive) mask, its rows split with the queries: its first s + n keys
        mask = (own.narrow(-1, 0, seen) if own.shape[-1] != 1 else own) + mask
    bound.update(is_causal=False, key=bound["key"].narrow(SEQ, 0, seen), value=bound["value"].narrow(SEQ, 0, seen),
                 attn_mask=mask)
    positional = len(args)
    out = func(*(bound[a] for a in names[:positional]), **{a: bound[a] for a in names[positional:] if a in bound})
    if "grad_out" not in bound:
        return out
    pad = (0, 0, 0, keys - seen)
    return out[0], torch.nn.functional.pad(out[1], pad), torch.nn.functional.pad(out[2], pad)


def _partial_grad(call) -> bool:
    s = call.actual(0)
    return s is not None and s.is_partial and s.op == "sum"


@register(*FORWARD[1:])
def attention(call):
    return _signatures(call, backward=False)


@register(*BACKWARD[1:])
def attention_backward(call):
    return _signatures(call, backward=True)


@register(FORWARD[0], local=_causal_rows)
def cpu_attention(call):
    return _signatures(call, backward=False, seq_split=True)


@register(BACKWARD[0], local=_causal_rows)
def cpu_attention_backward(call):
    return _signatures(call, backward=True, seq_split=True)
