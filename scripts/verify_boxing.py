"""Check every boxing pair against the single-device tensor and docs/design.md's cost table.

    python scripts/verify_boxing.py

Runs on 5 local gloo ranks: every pair of 1-d SBPs (S(0), S(1), B, P(sum),
P(max), P(min)) on 1, 2, 3 and 4 ranks (3 uses a 7x5 tensor, so splits are
uneven), the same pairs across disjoint placements 2->2, 2->1, 1->2, 2->3,
and 2-d pairs on a 2x2 mesh. For each pair it prints the values' max error
against the global tensor and the ledger's bytes (summed over ranks) against
the table. Values must be bit-identical unless partial sums are reduced
(then within 1e-6 relative).
"""
from __future__ import annotations

import itertools
import math
import sys

import torch


import sbp_core as sc
from sbp_core import sbp
from sbp_core.layout import local_box, reduce_terms, box_slices, take_local

WORLD = 5
ONE_D = [sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum, sbp.partial_max, sbp.partial_min]
TWO_D_AXIS = [sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum]


# -- the docs/design.md table, written out independently of sbp_core's cost model --
def table_same(a, b, p, T, shape):
    if a == b or p == 1:
        return 0
    kind = lambda s: "S" if s.is_split else "B" if s.is_broadcast else "P"  # noqa: E731
    ka, kb = kind(a), kind(b)
    if ka == "S" and kb == "S":
        # (p-1)/p |T| for even pieces; in general every piece but the diagonal ones.
        rows = [len(r) for r in torch.tensor_split(torch.arange(shape[a.axis]), p)]
        cols = [len(c) for c in torch.tensor_split(torch.arange(shape[b.axis]), p)]
        other = T // (shape[a.axis] * shape[b.axis])
        return T - sum(r * c for r, c in zip(rows, cols)) * other
    return {
        ("S", "B"): (p - 1) * T, ("S", "P"): 0, ("B", "S"): 0, ("B", "P"): 0,
        ("P", "S"): (p - 1) * T, ("P", "B"): 2 * (p - 1) * T, ("P", "P"): (p - 1) * T,
    }[(ka, kb)]


def table_disjoint(a, b, p1, p2, T):
    kind = lambda s: "S" if s.is_split else "B" if s.is_broadcast else "P"  # noqa: E731
    return {
        ("S", "S"): T, ("S", "B"): p2 * T, ("S", "P"): T,
        ("B", "S"): T, ("B", "B"): p2 * T, ("B", "P"): T,
        ("P", "S"): p1 * T, ("P", "B"): (p1 + p2 - 1) * T, ("P", "P"): p1 * T,
    }[(kind(a), kind(b))]


def cases():
    out = []
    for p in (1, 2, 3, 4):
        # On 3 ranks: no dim divides evenly, and only the first does (an all-to-all's pieces then differ in size).
        for shape in ((7, 5), (6, 5)) if p == 3 else ((8, 12),):
            for a, b in itertools.product(ONE_D, ONE_D):
                out.append(("same", list(range(p)), (a,), list(range(p)), (b,), shape))
    for src, dst in (([0, 1], [2, 3]), ([0, 1], [2]), ([0], [1, 2]), ([0, 1], [2, 3, 4])):
        shape = (7, 5) if len(dst) == 3 else (8, 12)
        for a, b in itertools.product(ONE_D, ONE_D):
            out.append(("disjoint", src, (a,), dst, (b,), shape))
    nd = list(itertools.product(TWO_D_AXIS, TWO_D_AXIS)) + [(sbp.partial_max, sbp.partial_max)]
    mesh = [[0, 1], [2, 3]]
    for a, b in itertools.product(nd, nd):
        out.append(("2d", mesh, a, mesh, b, (8, 12)))
    return out


def source_locals(case, seed):
    """Global value and every source rank's local, the same on every process."""
    _, src_ranks, src, _, _, shape = case
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g)
    mesh = torch.tensor(src_ranks)
    mesh_shape = tuple(mesh.shape)
    ranks = mesh.flatten().tolist()
    coords = {r: tuple(int(c) for c in torch.nonzero(mesh == r)[0]) for r in ranks}
    n_partial = math.prod(n for n, s in zip(mesh_shape, src) if s.is_partial)
    locals_ = {r: take_local(full, mesh_shape, src, coords[r]) for r in ranks}
    # Partial sources: random terms; for sum the value is their sum, for
    # max/min the first term of each group is the value and the others lie
    # below/above it, so the extremum is exact.
    op = next((s.op for s in src if s.is_partial), None)
    if n_partial > 1:
        groups = {}
        for r in ranks:
            key = tuple(c for c, s in zip(coords[r], src) if not s.is_partial)
            groups.setdefault(key, []).append(r)
        full = full.clone()
        for members in groups.values():
            box = box_slices(local_box(shape, mesh_shape, src, coords[members[0]]))
            for r in members:
                # Replicas (broadcast axes) must hold the same terms: seed by the partial coordinates.
                term = sum(c * 10 ** i for i, (c, s) in enumerate(zip(coords[r], src)) if s.is_partial)
                noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1000 + term))[box]
                locals_[r] = {"sum": noise, "max": full[box] - noise.abs(), "min": full[box] + noise.abs()}[op]
            if op == "sum":
                full[box] = torch.stack([locals_[r].double() for r in members]).sum(0).float()
            else:
                locals_[members[0]] = full[box].clone()
    return full, locals_


def worker(batch):
    me = torch.distributed.get_rank()
    results = []
    for idx, case in batch:
        kind, src_ranks, src, dst_ranks, dst, shape = case
        src_pl = sc.placement("cpu", src_ranks)
        dst_pl = sc.placement("cpu", dst_ranks)
        _, locals_ = source_locals(case, idx)
        x = sc.to_global(locals_.get(me), placement=src_pl, sbp=src)
        with sc.comm_ledger() as ledger:
            y = x.to_global(placement=dst_pl, sbp=dst)
        results.append((y.to_local().detach().clone() if me in dst_pl else None, ledger.bytes))
    return results


def check(case, idx, per_rank):
    kind, src_ranks, src, dst_ranks, dst, shape = case
    full, _ = source_locals(case, idx)
    mesh = torch.tensor(dst_ranks)
    ranks = mesh.flatten().tolist()
    coords = {r: tuple(int(c) for c in torch.nonzero(mesh == r)[0]) for r in ranks}
    summed = any(s.is_partial and s.op == "sum" for s in src)
    if any(s.is_partial for s in dst):
        ops = {s.op for s in dst if s.is_partial}
        # Reduce the destination terms of each box back to the value.
        got = full.clone().fill_(float("nan"))
        groups = {}
        for r in ranks:
            groups.setdefault(tuple(c for c, s in zip(coords[r], dst) if not s.is_partial), []).append(r)
        for members in groups.values():
            box = box_slices(local_box(shape, tuple(mesh.shape), dst, coords[members[0]]))
            got[box] = reduce_terms([per_rank[r][0] for r in members], ops.pop() if len(ops) == 1 else "sum")
        err = (got - full).abs().max().item()
        summed = summed or "sum" in {s.op for s in dst if s.is_partial}
    else:
        err = 0.0
        for r in ranks:
            want = take_local(full, tuple(mesh.shape), dst, coords[r])
            err = max(err, (per_rank[r][0] - want).abs().max().item() if want.numel() else 0.0)
    T = math.prod(shape) * 4
    measured = sum(b for _, b in per_rank.values())
    if kind == "same":
        expected = table_same(src[0], dst[0], len(src_ranks), T, shape)
    elif kind == "disjoint":
        expected = table_disjoint(src[0], dst[0], len(src_ranks), len(dst_ranks), T)
    else:
        _, expected = sc.boxing_plan(src, dst, (2, 2), shape, 4)
    scale = full.abs().max().item()
    ok_value = err <= 1e-6 * scale if summed else err == 0.0
    ok_bytes = measured == round(expected)
    return err, measured, expected, ok_value and ok_bytes


def verify(pool):
    """Run every case on ``pool`` (5 ranks); yield ``(line, ok)`` per case."""
    batch = list(enumerate(cases()))
    results = pool.run(worker, batch)
    for idx, case in batch:
        per_rank = {r: results[r][idx] for r in range(WORLD)}
        err, measured, expected, ok = check(case, idx, per_rank)
        kind, sr, src, dr, dst, shape = case
        name = f"{kind:8s} {str(sr):14s} {sc.sbp.format_sbp(src):16s} -> {str(dr):14s} {sc.sbp.format_sbp(dst):16s}"
        yield f"{name} {str(shape):8s} max_err={err:.2e} bytes={measured:6d} table={expected:8.0f} {'ok' if ok else 'FAIL'}", ok


def main():
    from toolkit.rank_pool import get_pool

    good = total = 0
    for line, ok in verify(get_pool(WORLD)):
        print(line)
        good += ok
        total += 1
    print(f"boxing pairs exact: {good}/{total}")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
