"""CUDA's fused attention kernels get the CPU kernel's SBP rules.

On CPU the CUDA kernels cannot run, but their meta functions can, and that is
all the dispatcher's decision needs. For each layout (batch split, heads
split, sequence split, replicated, a 2x2 mesh, masks, a partial incoming
gradient) every rank builds the same global inputs for the CPU kernel and for
each CUDA kernel (flash, memory-efficient, cuDNN; forward and backward) and
asks the dispatcher to decide: the layouts it boxes each named input to and
the layouts of the attention's outputs must equal the ones written out for
the case (``EXPECTED``), for the CPU kernel and each CUDA kernel alike. The
CPU kernel's values are checked against one device in ``test_ops_nn`` and,
for grouped-query attention (heads not split), here; the CUDA kernels'
values, shard by shard, in the ``cuda`` test at the end.
"""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from sbp_core.decide import decide
from sbp_core.ops.attention import _ACTIVATIONS, _MASKS
from toolkit.rank_pool import get_pool

from . import parity

aten = torch.ops.aten
R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1, S2 = sbp.split(0), sbp.split(1), sbp.split(2)
B, P = sbp.broadcast, sbp.partial_sum

FORWARD = {
    "cpu": aten._scaled_dot_product_flash_attention_for_cpu.default,
    "flash": aten._scaled_dot_product_flash_attention.default,
    "efficient": aten._scaled_dot_product_efficient_attention.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention.default,
}
BACKWARD = {
    "cpu": aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    "flash": aten._scaled_dot_product_flash_attention_backward.default,
    "efficient": aten._scaled_dot_product_efficient_attention_backward.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
}


def _forward_args(kernel, q, k, v, mask, dropout=0.0):
    if kernel == "cpu":
        return (q, k, v, dropout, mask is None), ({"attn_mask": mask} if mask is not None else {})
    if kernel == "flash":
        return (q, k, v, dropout, True), {}
    return (q, k, v, mask, True, dropout, mask is None), {}


def _zeros_like_meta(out):
    return [torch.zeros(o.shape, dtype=o.dtype) if isinstance(o, torch.Tensor) else o for o in out]


def _backward_args(kernel, g, q, k, v, mask, dropout=0.0):
    """The kernel's backward arguments, its forward's outputs made from its meta function's shapes."""
    meta = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in (q, k, v, mask)]
    args, kwargs = _forward_args(kernel, *meta)
    o = _zeros_like_meta(FORWARD[kernel](*args, **kwargs))
    causal = mask is None
    if kernel == "cpu":
        return (g, q, k, v, o[0], o[1], dropout, causal), ({"attn_mask": mask} if mask is not None else {})
    if kernel == "flash":
        return (g, q, k, v, o[0], o[1], o[2], o[3], o[4], o[5], dropout, causal, o[6], o[7]), {}
    if kernel == "efficient":
        return (g, q, k, v, mask, o[0], o[1], o[2], o[3], dropout, [True, True, True, False], causal), {}
    return (g, q, k, v, o[0], o[1], o[6], o[7], mask, o[2], o[3], o[4], o[5], dropout, causal), {}


_CANONICAL = {"grad_out_": "grad_out", "attn_bias": "attn_mask"}  # one name per role across the kernels


def _role(name: str) -> str:
    return "activation" if name in _ACTIVATIONS else "mask" if name in _MASKS else "other"


def _decision(func, args, kwargs, ranks, act, mask_sbp, grad_sbp):
    """``(required SBP per named input, SBPs of the attention's outputs)`` the dispatcher picks."""
    p = sc.placement("cpu", ranks)
    names = [s.name for s in func._schema.arguments]
    named = list(zip(names, args)) + list(kwargs.items())

    def lay(name, t):
        if not isinstance(t, torch.Tensor):
            return t
        role = _role(name)
        layout = grad_sbp if name.startswith("grad_out") and grad_sbp is not None else \
            act if role == "activation" else mask_sbp if role == "mask" else (B,) * len(act)
        return sc.distribute(t, p, layout)

    glob = [lay(n, a) for n, a in named]
    pos, kw = glob[: len(args)], dict(zip(kwargs, glob[len(args):]))
    d = decide(func, tuple(pos), kw)
    present = [n for n, a in named if isinstance(a, torch.Tensor)]
    required = {_CANONICAL.get(n, n): r for n, r in zip(present, d.required) if _role(n) != "other"}
    n_act = 3 if "grad_out" in present[0] else 2
    outs = [o[0].sbp for o in d.out_layouts if o is not None][:n_act]
    return required, outs


def _decide_all(cases):
    """Worker: for each case, every kernel's forward and backward decision (or the error it raised)."""
    g = torch.Generator().manual_seed(0)
    results = []
    for shape, kv_heads, ranks, act, mask_shape, mask_sbp, grad_sbp, dropout in cases:
        n, h, L, e = shape
        q = torch.randn(shape, generator=g)
        k = torch.randn(n, kv_heads, L, e, generator=g)
        v = torch.randn(n, kv_heads, L, e, generator=g)
        mask = None if mask_shape is None else torch.randn(mask_shape, generator=g)
        grad = torch.randn(shape, generator=g)
        per = {}
        for kernel in FORWARD:
            if mask is not None and kernel == "flash":
                continue  # flash takes no mask: torch picks another kernel then
            for which, func, (args, kwargs) in (
                ("forward", FORWARD[kernel], _forward_args(kernel, q, k, v, mask, dropout)),
                ("backward", BACKWARD[kernel], _backward_args(kernel, grad, q, k, v, mask, dropout)),
            ):
                if which == "forward" and grad_sbp is not None:
                    continue
                try:
                    per[(kernel, which)] = _decision(func, args, kwargs, ranks, act, mask_sbp, grad_sbp)
                except ValueError as exc:
                    per[(kernel, which)] = f"ValueError: {exc}"
        results.append(per if torch.distributed.get_rank() in sc.placement("cpu", ranks) else None)
    return results


CASES = [  # (q shape, kv heads, ranks, activations' SBP, mask shape, mask SBP, grad_out SBP, dropout)
    ((4, 3, 5, 8), 3, R2, (S0,), None, None, None, 0.0),
    ((4, 3, 5, 8), 3, R3, (S1,), None, None, None, 0.0),
    ((4, 3, 5, 8), 3, R2, (B,), None, None, None, 0.0),
    ((4, 3, 5, 8), 3, R2, (S2,), None, None, None, 0.0),  # sequence split: boxed before attention
    ((4, 2, 6, 8), 2, M22, (S0, S1), None, None, None, 0.0),
    ((4, 3, 5, 8), 3, R2, (S1,), (4, 1, 5, 5), (B,), None, 0.0),  # mask broadcast over heads
    ((4, 3, 5, 8), 3, R3, (S0,), (4, 1, 5, 5), (S0,), None, 0.0),
    ((4, 2, 6, 8), 2, M22, (S0, S1), (4, 2, 6, 6), (S0, S1), None, 0.0),
    ((4, 3, 5, 8), 1, R2, (S1,), None, None, None, 0.0),  # grouped-query: kv heads cannot split with q's
    ((4, 3, 5, 8), 3, R2, (B,), None, None, (P,), 0.0),  # a partial incoming gradient stays partial
    ((4, 3, 5, 8), 3, R2, (S0,), None, None, None, 0.25),  # in-kernel dropout is refused
]


# What each case must decide, written out (not read from the CPU kernel's decision): the layout every
# activation is boxed to, the mask's, and the incoming gradient's (None: the activations'); the outputs
# (attention and log-sum-exp forward, the three gradients backward) take the gradient's layout.
REFUSED = "refused"
EXPECTED = [  # (activations, mask, grad_out), one per case of CASES
    ((S0,), None, None),
    ((S1,), None, None),
    ((B,), None, None),
    ((S0,), None, None),  # the sequence split is boxed to a batch split (the CPU backward: CPU_EXPECTED)
    ((S0, S1), None, None),
    ((S1,), (B,), None),
    ((S0,), (S0,), None),
    ((S0, S1), (S0, S1), None),
    ((S0,), None, None),  # grouped-query: heads are not offered, the batch split is
    ((B,), None, (P,)),
    REFUSED,
]


# The CPU kernel alone also takes queries split on the sequence with keys and values whole (the
# context-parallel layout); given the sequence split, its backward keeps it: no boxing of the gradient.
CPU_EXPECTED = {(3, "backward"): ({"grad_out": (S2,), "query": (S2,), "key": (B,), "value": (B,), "out": (S2,),
                                   "logsumexp": (S2,)}, [(S2,), (P,), (P,)])}


def _expected(which, act, mask, grad):
    names = ["query", "key", "value"] + (["grad_out", "out", "logsumexp"] if which == "backward" else [])
    req = {n: act for n in names}
    if mask is not None:
        req["attn_mask"] = mask
    if which == "forward":
        return req, [act, act]
    req["grad_out"] = grad or act
    return req, [grad or act] * 3


def test_cuda_kernels_decide_as_the_cpu_kernel():
    results = get_pool(parity.WORLD).run(_decide_all, CASES)
    bad, compared = [], 0
    for c, case in enumerate(CASES):
        for rank, per_rank in enumerate(results):
            if per_rank is None or per_rank[c] is None:
                continue
            per = per_rank[c]
            kernels = {kernel for kernel, _ in per}
            if kernels != ({"cpu", "efficient", "cudnn"} if case[4] else set(FORWARD)):
                bad.append(f"case {c} rank {rank}: decided for {sorted(kernels)}")
            for (kernel, which), got in per.items():
                if EXPECTED[c] is REFUSED:
                    want = "ValueError: ... dropout_p ..."
                    ok = isinstance(got, str) and "dropout_p" in got
                else:
                    want = CPU_EXPECTED.get((c, which)) if kernel == "cpu" else None
                    want = want or _expected(which, *EXPECTED[c])
                    ok = got == want
                compared += 1
                if not ok:
                    bad.append(f"case {c} {case[2:4]} rank {rank} {kernel} {which}: {got}, expected: {want}")
    assert compared >= 150 and not bad, "\n".join(bad)


def test_cuda_kernel_decisions_keep_heads_and_batch_splits():
    # The table itself, not only its agreement with the CPU kernel: S(1) stays S(1) with no boxing,
    # a sequence split is boxed to a split attention can run on, a partial gradient flows through.
    results = get_pool(parity.WORLD).run(_decide_all, [CASES[1], CASES[3], CASES[9]])[0]
    heads, seq, partial = results
    for kernel in ("flash", "efficient", "cudnn"):
        req, outs = heads[(kernel, "forward")]
        assert set(req.values()) == {(S1,)} and outs == [(S1,), (S1,)], (kernel, req, outs)
        req, outs = heads[(kernel, "backward")]
        assert set(req.values()) == {(S1,)} and outs == [(S1,)] * 3, (kernel, req, outs)
        req, _ = seq[(kernel, "forward")]
        assert req["query"] in ((S0,), (S1,), (B,)) and req["query"] != (S2,), (kernel, req)
        req, outs = partial[(kernel, "backward")]
        assert req["grad_out"] == (P,) and outs == [(P,)] * 3, (kernel, req, outs)


def gqa_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_grouped_query_attention_is_not_split_on_heads():
    """12 query heads share 4 key/value heads (3 each): splitting both on heads over 3 ranks would pair
    query heads 0-3 with key/value heads 0-1, not 0-0-0-1. The heads split is boxed away: to the batch, or, where
    the keys and values come whole, to the CPU kernel's query rows (as cheap a boxing of the query alone)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 12, 5, 4, generator=g)
    k, v = (torch.randn(3, 4, 5, 4, generator=g) for _ in range(2))
    parity.check_cases([
        (gqa_attention, [q, k, v], [S1, S1, S1], R3, [S0]),
        (gqa_attention, [q, k, v], [S1, B, B], R3, [S2]),
    ])


def causal_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def masked_attention(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_masked_attention(q, k, v, mask):
    """The CPU kernel with both masks (``F.scaled_dot_product_attention`` refuses the pair; the kernel adds them)."""
    return FORWARD["cpu"](q, k, v, 0.0, True, attn_mask=mask.detach())[0]


def test_queries_split_on_the_sequence_attend_to_the_keys_before_them():
    """The context-parallel layout on the CPU kernel: queries ``S(2)``, keys and values ``B``. Under ``is_causal``
    each rank's query block attends to the keys up to its own positions (rank 1's first query sees the keys of
    rank 0's block), so the result is one device's only if the causal mask moves with the block; the key and
    value gradients come back partial. Uneven blocks (7 positions over 3 ranks), a 2x2 mesh with the batch
    split too, an explicit mask (its rows split with the queries), the causal mask and an explicit one
    together, and a rank with no query (2 positions over 3 ranks: the kernel fails on an empty sequence, so the
    empty block's outputs are made without it)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g) for _ in range(3))
    mask = torch.rand(7, 7, generator=g) > 0.3
    mask[:, 0] = True  # every query attends to something
    bias = torch.randn(2, 1, 7, 7, generator=g)
    short = [t[:, :, :2] for t in (q, k, v)]
    parity.check_cases([
        (causal_attention, [q, k, v], [S2, B, B], R2, [S2]),
        (causal_attention, [q, k, v], [S2, B, B], R3, [S2]),
        (causal_attention, [q, k, v], [(S0, S2), (S0, B), (S0, B)], M22, [(S0, S2)]),
        (masked_attention, [q, k, v, mask], [S2, B, B, B], R3, [S2]),
        (causal_masked_attention, [q, k, v, bias], [S2, B, B, S2], R3, [S2]),
        (causal_attention, short, [S2, B, B], R3, [S2]),
    ])


def _one_sample_decision():
    """The layouts the dispatcher boxes a batch of one sample's query, key and value to, given them split on the
    sequence over 2 ranks (context parallelism with a micro-batch of one)."""
    p = sc.placement("cpu", R2)
    q, k, v = (sc.distribute(torch.randn(1, 4, 8, 4), p, (S2,)) for _ in range(3))
    d = decide(FORWARD["cpu"], (q, k, v, 0.0, True), {})
    return [r[0] for r in d.required[:3]]


def test_one_sample_is_not_split_on_its_batch():
    """Splitting the batch dim of one sample over two ranks costs the fewest bytes (an all-to-all of the query,
    key and value, half of them empty), and leaves one rank all the attention: a boxing that starves a rank is
    chosen only where nothing else applies. Here the heads are split (an all-to-all each way)."""
    got = get_pool(parity.WORLD).run(_one_sample_decision)[0]
    assert got == [S1, S1, S1], got


def test_asking_for_the_bias_gradient_is_refused():
    from sbp_core.ops.attention import attention_backward
    from sbp_core.ops.registry import Call, TensorMeta

    m = TensorMeta(torch.Size([4, 3, 5, 8]), torch.float32)
    bias = TensorMeta(torch.Size([4, 3, 5, 5]), torch.float32)
    lse = TensorMeta(torch.Size([4, 3, 32]), torch.float32)
    seed = TensorMeta(torch.Size([]), torch.int64)
    call = Call(BACKWARD["efficient"], (m, m, m, m, bias, m, lse, seed, seed, 0.0, [True, True, True, True], False),
                {}, [m, m, m, m, bias, m, lse, seed, seed], p=2)
    with pytest.raises(ValueError, match="bias's gradient"):
        attention_backward(call)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("dim", [0, 1])
def test_cuda_kernels_compute_shard_by_shard_what_they_compute_whole(backend, dim):
    """What the rule asserts, on the real kernels: attention (and its input gradients) of a batch or heads
    shard is that shard of the whole's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    w = torch.randn(4, 4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*whole, is_causal=True)
        (out.float() * w).sum().backward()
        for piece in range(2):
            part = [t.chunk(2, dim)[piece].clone().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*part, is_causal=True)
            (o.float() * w.chunk(2, dim)[piece]).sum().backward()
            # Flash and memory-efficient attention split their work by (batch, head), so a shard's output is
            # the whole's bit for bit; cuDNN may pick another engine for the half shape: bf16's tolerance.
            exact = {"rtol": 0, "atol": 0} if backend != "CUDNN_ATTENTION" else {}
            torch.testing.assert_close(o, out.chunk(2, dim)[piece], **exact)
            for a, b in zip(part, whole):
                torch.testing.assert_close(a.grad, b.grad.chunk(2, dim)[piece], rtol=2e-2, atol=2e-2)
