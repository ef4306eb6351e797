"""Check that a function of global tensors equals the same function on one device.

``check(fn, inputs, layouts, ranks)`` lays each full input tensor out as its
N-d SBP on ``sc.placement("cpu", ranks)``, runs ``fn`` on the global
tensors and on the plain tensors, and compares every output and (for
floating inputs) every input gradient of ``sum(out * W)`` with fixed random
``W``, to ``rtol`` relative to each tensor's largest magnitude (and equal
dtypes). Runs on the shared 5-rank pool; ``fn`` must be a module-level function.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from toolkit.rank_pool import get_pool

WORLD = 5


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _worker(fn, inputs, layouts, ranks, grad):
    p = sc.placement("cpu", ranks)
    me = torch.distributed.get_rank()
    ref_in = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    glob = [sc.distribute(t, p, s, requires_grad=grad and t.is_floating_point()) for t, s in zip(inputs, layouts)]
    ref_out = _flat(fn(*ref_in))
    out = _flat(fn(*glob))
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(o.shape, generator=gen) for o in ref_out]
    errs = {}
    if me not in p:
        # Ranks outside still take part in every collective-free step; nothing to compare.
        if grad:
            loss = sum((o * sc.distribute(w, p, tuple(sc.sbp.broadcast for _ in o.sbp))).sum() for o, w in zip(out, weights))
            loss.backward()
        return None
    for k, (o, r) in enumerate(zip(out, ref_out)):
        got = o.full_tensor()
        errs[f"out{k} {sc.sbp.format_sbp(o.sbp)}"] = _rel(got, r)
    if grad:
        ref_loss = sum((r * w).sum() for r, w in zip(ref_out, weights))
        ref_loss.backward()
        loss = sum((o * sc.distribute(w, p, tuple(sc.sbp.broadcast for _ in o.sbp))).sum() for o, w in zip(out, weights))
        loss.backward()
        for k, (g, r) in enumerate(zip(glob, ref_in)):
            if r.grad is not None:
                errs[f"grad{k} {sc.sbp.format_sbp(g.grad.sbp)}"] = _rel(g.grad.full_tensor(), r.grad)
    return errs


def _rel(got, want) -> float:
    """Largest difference relative to ``want``'s largest finite magnitude; ``inf`` when shape or dtype differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()  # bool and integer outputs too
    diff = (got - want).abs().masked_fill(got == want, 0.0)  # equal infinities agree; NaN never does
    finite = want[want.isfinite()]
    scale = finite.abs().max().clamp_min(1e-12) if finite.numel() else 1.0
    return (diff.max() / scale).item()


def check(fn, inputs, layouts, ranks, grad=True, rtol=1e-5):
    """Assert ``fn`` on global tensors equals ``fn`` on one device (values and gradients)."""
    layouts = [s if isinstance(s, tuple) else (s,) for s in layouts]
    results = get_pool(WORLD).run(_worker, fn, inputs, layouts, ranks, grad)
    bad = []
    for rank, errs in enumerate(results):
        for name, err in (errs or {}).items():
            if not err <= rtol:
                bad.append(f"rank {rank} {name}: rel err {err:.2e}")
    assert not bad, f"{fn.__name__} with layouts {layouts} on {ranks}:\n" + "\n".join(bad)


def _run_cases(cases):
    """Worker: run each ``(fn, inputs, layouts, ranks, grad)``; return its errors and output SBPs."""
    results = []
    for fn, inputs, layouts, ranks, grad in cases:
        seen = []

        def traced(*args, fn=fn, seen=seen):
            out = fn(*args)
            flat = _flat(out)
            if isinstance(flat[0], sc.GlobalTensor):
                seen.append([o.sbp for o in flat])
            return out

        try:
            errs = _worker(traced, inputs, layouts, ranks, grad)
        except Exception as e:  # noqa: BLE001  (reported per case; ranks fail alike)
            errs = {"raised": f"{type(e).__name__}: {e}"}
        results.append((errs, seen[0] if seen else None))
    return results


def _matches(got, want) -> bool:
    """``want``: a predicate, or one N-d SBP per output (a bare SBP for 1-d, ``None`` to skip one)."""
    if callable(want):
        return want(got)
    want = [w if isinstance(w, tuple) or w is None else (w,) for w in want]
    return got is not None and len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def check_cases(cases, rtol=1e-5):
    """Many ``check``s in one pool call, optionally asserting the output layouts.

    ``cases``: ``(fn, inputs, layouts, ranks[, expected output SBPs or None[, grad]])``.
    """
    norm = []
    for c in cases:
        fn, inputs, layouts, ranks = c[:4]
        grad = c[5] if len(c) > 5 else True
        norm.append((fn, inputs, [s if isinstance(s, tuple) else (s,) for s in layouts], ranks, grad))
    results = get_pool(WORLD).run(_run_cases, norm)
    bad = []
    for i, (c, (fn, _, layouts, ranks, _)) in enumerate(zip(cases, norm)):
        want = c[4] if len(c) > 4 else None
        for rank, per_case in enumerate(results):
            errs, sbps = per_case[i]
            if errs is None:
                continue
            for name, err in errs.items():
                if isinstance(err, str) or not err <= rtol:
                    bad.append(f"{fn.__name__} {layouts} on {ranks}: rank {rank} {name}: {err}")
            if want is not None and rank == 0 and not _matches(sbps, want):
                bad.append(f"{fn.__name__} {layouts} on {ranks}: output sbp {sbps}, expected {want}")
    assert not bad, "\n".join(bad)
