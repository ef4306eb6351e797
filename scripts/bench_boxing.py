"""Time same-placement boxing against bare ``torch.distributed`` and ``DTensor.redistribute``.

    python scripts/bench_boxing.py [--ranks 2|4] [--size 1024] [--reps 50]

Runs on a pool of local gloo ranks (CPU, one thread each). For every ordered
pair of distinct 1-d SBPs among S(0), S(1), B, P(sum), P(max) on a 1-d
placement of all ranks, with an fp32 ``size x size`` global tensor, it times
in the same worker processes, interleaved repetition by repetition:

- ``ours``: ``x.to_global(sbp=dst)`` under ``torch.no_grad()``, where ``x`` is
  a GlobalTensor built once with ``sc.to_global(local, placement, sbp=src)``;
- ``grad``: the same call with autograd recording (``x`` from a local that
  requires grad; no backward), reported for information only;
- ``bare``: the shortest ``torch.distributed`` sequence a person would write
  on the local tensors for that transition, returning a new tensor wherever
  ours does (see ``bare_fn``);
- ``bare'``: the same bare sequence again, timed as an implementation of its
  own: ``bare'/bare`` is what a pair reads when there is no difference at all,
  so its worst over the pairs is the resolution of the bench (its noise floor);
- ``DTensor``: ``dt.redistribute(mesh, [dst])`` under ``torch.no_grad()``,
  where ``dt = DTensor.from_local(local, mesh, [src], run_check=False)`` was
  built once on ``init_device_mesh("cpu", (n,))``. Pairs DTensor refuses
  (redistributing *to* Partial is internal-only in torch 2.13) print ``n/a``.

Before timing, every implementation's output is checked against the bare one
(same local shard on every rank), so the timings compare equal work.

Timing: per pair, ``--warmup`` untimed calls of each implementation, then
``--reps`` repetitions; in each repetition every implementation runs once,
in a fresh random order (the same on every rank; a rotation kept each
implementation after the same other one in three repetitions of four,
ours right after DTensor's call), each call preceded by a barrier and
timed alone with ``time.perf_counter``. Each rank takes the **median** of its
repetitions; the reported time is the **max over ranks of those medians**
(the slowest rank bounds a collective step). The ``90% CI`` column is a
paired bootstrap interval of ours/bare (repetitions resampled alike for both
and for every rank): on a small shared machine single gloo calls vary by 2-3x,
so ratios within that interval of 1.0 are noise, not a slowdown.

Repetitions: the default (400 on 2 ranks, 200 on 4; about 4 minutes) is sized
to resolve the 1.1x bar. On this 2-core host, in windows of 50 repetitions cut
from one 400-repetition run, ``bare'/bare`` over the 13 collective pairs had a
worst of 1.18x by median (above 1.1x in 95% of windows); at 200, 1.08x (30%);
at 400, 1.07x.

Summary line: ``boxing vs bare (worst)`` is the largest ours/bare ratio over
every pair, and ``with a collective`` the largest over the pairs where the
bare sequence calls one (S->S, S->B, P->S, P->B, P->P); the pairs that are
local in every implementation (B->S, B->P, S->P) are flagged ``local`` in
the table, and there the ratio is Python call overhead against a bare slice
or fill. ``vs DTensor (worst)`` is the largest ours/DTensor ratio
over every pair DTensor supports; ``noise floor`` is the worst ``bare'/bare``
(either way round) over the collective pairs. A small-tensor table (``--small``, default
8x8) is printed first and shows per-call overhead; it is not in the summary.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from sbp_core.torch_compat import all_gather_flat, reduce_scatter_flat

SBPS = ["S(0)", "S(1)", "B", "P(sum)", "P(max)"]
PAIRS = [(a, b) for a in SBPS for b in SBPS if a != b]
IMPLS = ["ours", "grad", "bare", "bare'", "dtensor"]
AA = "bare'/bare"


def _kind(name: str) -> str:
    return name[0]


def _op(name: str) -> str:
    return name[2:-1]  # "P(sum)" -> "sum"


def _axis(name: str) -> int:
    return int(name[2])  # "S(1)" -> 1


def is_local_pair(src: str, dst: str) -> bool:
    """True when the bare sequence calls no collective (B->S, B->P, S->P)."""
    return _kind(src) == "B" or (_kind(src) == "S" and _kind(dst) == "P")


def _identity(op: str) -> float:
    return 0.0 if op == "sum" else float("-inf") if op == "max" else float("inf")


def make_local(name: str, shape, n: int, me: int, seed: int) -> torch.Tensor:
    """This rank's local tensor of a global ``shape`` tensor laid out as ``name``."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if _kind(name) == "S":
        return torch.tensor_split(full, n, _axis(name))[me].contiguous()
    if _kind(name) == "B":
        return full
    # Partial: an independent random term per rank (any terms are a valid partial value).
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + 1 + me))


def bare_fn(src: str, dst: str, local: torch.Tensor, shape, n: int, me: int):
    """The minimal ``torch.distributed`` sequence for ``src -> dst`` on this rank's ``local``.

    Even splits only (sizes divisible by ``n``). Returns a zero-argument
    callable producing the new local tensor. One branch per pair, kept in
    one function: the bare sequences side by side are the table the
    benchmark compares ours against.
    """
    import torch.distributed as dist

    R, C = shape
    ka, kb = _kind(src), _kind(dst)
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if ka == "S" and kb == "S":
        if _axis(src) == 0:  # S(0) -> S(1): column block k of my rows goes to rank k

            def f():
                inp = torch.cat(local.chunk(n, 1))
                out = torch.empty(R, C // n)
                dist.all_to_all_single(out, inp)
                return out

            return f

        def f():  # S(1) -> S(0): row block k of my columns goes to rank k
            out = torch.empty(n, R // n, C // n)
            dist.all_to_all_single(out, local)
            return out.transpose(0, 1).reshape(R // n, C)

        return f
    if ka == "S" and kb == "B":
        if _axis(src) == 0:

            def f():
                out = torch.empty(R, C)
                all_gather_flat(out, local)
                return out

            return f

        def f():
            buf = torch.empty(n * R, C // n)
            all_gather_flat(buf, local)
            return torch.cat(buf.chunk(n), 1)

        return f
    if ka == "S" and kb == "P":
        d, ident = _axis(src), _identity(_op(dst))
        length = local.shape[d]

        def f():
            out = torch.full((R, C), ident)
            out.narrow(d, me * length, length).copy_(local)
            return out

        return f
    if ka == "B" and kb == "S":
        d = _axis(dst)
        length = shape[d] // n
        return lambda: local.narrow(d, me * length, length).contiguous()
    if ka == "B" and kb == "P":
        ident = _identity(_op(dst))
        return (lambda: local) if me == 0 else (lambda: torch.full_like(local, ident))
    op = red[_op(src)]
    if kb == "S":
        if _axis(dst) == 0:

            def f():
                out = torch.empty(R // n, C)
                reduce_scatter_flat(out, local, op=op)
                return out

            return f

        def f():
            out = torch.empty(R, C // n)
            reduce_scatter_flat(out, torch.cat(local.chunk(n, 1)), op=op)
            return out

        return f
    if kb == "B":

        def f():
            out = local.clone()
            dist.all_reduce(out, op=op)
            return out

        return f
    ident = _identity(_op(dst))  # P(a) -> P(b): reduce onto the first rank, identity elsewhere

    def f():
        out = local.clone()
        dist.reduce(out, dst=0, op=op)
        return out if me == 0 else torch.full_like(local, ident)

    return f


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    return t1 - t0, out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], b[~finite]):
        return False
    return torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-5)


def worker(shapes: list, reps: int, warmup: int, seed: int) -> dict:
    """On every rank: time every pair at every shape; ``{(shape, pair): {impl: [seconds]}}``.

    Kept whole so that the three implementations of a pair are set up, warmed up and timed by the same lines."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import sbp_core as sc
    from sbp_core import sbp

    n, me = dist.get_world_size(), dist.get_rank()
    placement = sc.placement("cpu", list(range(n)))
    mesh = init_device_mesh("cpu", (n,))
    ours_sbp = {"S(0)": sbp.split(0), "S(1)": sbp.split(1), "B": sbp.broadcast,
                "P(sum)": sbp.partial_sum, "P(max)": sbp.partial_max}
    dt_pl = {"S(0)": Shard(0), "S(1)": Shard(1), "B": Replicate(),
             "P(sum)": Partial("sum"), "P(max)": Partial("max")}
    results = {}
    for shape in shapes:
        for k, (src, dst) in enumerate(PAIRS):
            local = make_local(src, shape, n, me, seed + k)
            x = sc.to_global(local, placement=placement, sbp=ours_sbp[src])
            xg = sc.to_global(local.clone().requires_grad_(True), placement=placement, sbp=ours_sbp[src])
            target = ours_sbp[dst]

            def ours():
                return x.to_global(sbp=target)

            def grad():
                return xg.to_global(sbp=target)

            bare = bare_fn(src, dst, local, shape, n, me)
            dt = DTensor.from_local(local, mesh, [dt_pl[src]], run_check=False)
            dst_pl = [dt_pl[dst]]

            def dtensor():
                y = dt.redistribute(mesh, dst_pl)._local_tensor
                return y.wait() if isinstance(y, AsyncCollectiveTensor) else y

            fns = {"ours": ours, "grad": grad, "bare": bare, "bare'": bare_fn(src, dst, local, shape, n, me),
                   "dtensor": dtensor}
            with torch.no_grad():
                want = bare()
                for name in ("ours", "grad", "bare'", "dtensor"):
                    try:
                        got = fns[name]()
                    except RuntimeError as exc:
                        # Raised by DTensor's placement check before any communication.
                        if name != "dtensor" or "Partial" not in str(exc):
                            raise
                        fns[name] = None
                        continue
                    got = got.to_local() if name in ("ours", "grad") else got
                    if not _same(got.detach(), want):
                        raise ValueError(f"{name} {src}->{dst} {shape}: rank {me}'s local differs from bare")
            active = [name for name in IMPLS if fns[name] is not None]
            times = {name: [] for name in active}
            rng = random.Random(seed + k)  # the same orders on every rank
            for r in range(warmup + reps):
                order = rng.sample(active, len(active))
                for name in order:
                    with torch.set_grad_enabled(name == "grad"):
                        t, _ = _timed(fns[name])
                    if r >= warmup:
                        times[name].append(t)
            results[(tuple(shape), (src, dst))] = times
    dist.barrier()
    return results


def summarise(per_rank: list, shape, pairs, resamples: int = 300) -> dict:
    """``{pair: {impl: max over ranks of the rank's median seconds, "ci": (lo, hi) of ours/bare}}``."""
    rng = random.Random(0)
    out = {}
    for pair in pairs:
        key = (tuple(shape), pair)
        impls = per_rank[0][key].keys()
        row = {i: max(statistics.median(r[key][i]) for r in per_rank) for i in impls}
        reps = len(per_rank[0][key]["ours"])
        ratios = []
        for _ in range(resamples):
            idx = [rng.randrange(reps) for _ in range(reps)]
            ours = max(statistics.median(r[key]["ours"][k] for k in idx) for r in per_rank)
            bare = max(statistics.median(r[key]["bare"][k] for k in idx) for r in per_rank)
            ratios.append(ours / bare)
        ratios.sort()
        row["ci"] = (ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1])
        out[pair] = row
    return out


def print_table(title: str, stats: dict) -> tuple:
    """Print one table; return the worst ratios and their pairs.

    ``(ours/bare over collective pairs, pair, ours/DTensor, pair, ours/bare over local pairs, pair,
    bare'/bare either way round over collective pairs)``.
    """
    print(title)
    head = (f"{'pair':16s} {'ours us':>9s} {'grad us':>9s} {'bare us':>9s} {'DTensor us':>10s} "
            f"{'ours/bare':>9s} {'90% CI':>11s} {'ours/DT':>8s} {AA:>10s}")
    print(head)
    print("-" * len(head))
    worst_bare, worst_bare_pair = 0.0, None
    worst_local, worst_local_pair = 0.0, None
    worst_dt, worst_dt_pair = 0.0, None
    floor = 0.0
    for (src, dst), t in stats.items():
        us = {k: v * 1e6 for k, v in t.items() if k != "ci"}
        rb = t["ours"] / t["bare"]
        dt = f"{us['dtensor']:10.1f}" if "dtensor" in t else f"{'n/a':>10s}"
        rd = f"{t['ours'] / t['dtensor']:7.2f}x" if "dtensor" in t else f"{'n/a':>8s}"
        local = is_local_pair(src, dst)
        flag = "  local" if local else ""
        ci = f"{t['ci'][0]:.2f}-{t['ci'][1]:.2f}"
        aa = t["bare'"] / t["bare"]
        print(f"{src + ' -> ' + dst:16s} {us['ours']:9.1f} {us['grad']:9.1f} {us['bare']:9.1f} {dt} "
              f"{rb:8.2f}x {ci:>11s} {rd} {aa:9.2f}x{flag}")
        if not local:
            floor = max(floor, aa, 1 / aa)
        if local:
            if rb > worst_local:
                worst_local, worst_local_pair = rb, (src, dst)
        elif rb > worst_bare:
            worst_bare, worst_bare_pair = rb, (src, dst)
        if "dtensor" in t and t["ours"] / t["dtensor"] > worst_dt:
            worst_dt, worst_dt_pair = t["ours"] / t["dtensor"], (src, dst)
    print()
    return worst_bare, worst_bare_pair, worst_dt, worst_dt_pair, worst_local, worst_local_pair, floor


def _parse_size(text: str) -> tuple:
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if parts == [0, 0]:
        return None
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"size must be N or RxC, got {text!r}")
    return tuple(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="gloo ranks (default 2)")
    ap.add_argument("--size", type=_parse_size, default=(1024, 1024), help="global fp32 tensor, N or RxC (1024)")
    ap.add_argument("--small", type=_parse_size, default=(8, 8), help="overhead table's tensor (8); 0 skips")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per implementation and pair (400 on 2 ranks, 200 on 4)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (5)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = args.ranks
    if args.reps is None:
        args.reps = 400 if n == 2 else 200
    small = args.small
    if args.size is None:
        ap.error("--size must be positive")
    for s in [args.size] + ([small] if small else []):
        if s[0] % n or s[1] % n:
            ap.error(f"tensor {s[0]}x{s[1]} must divide evenly over {n} ranks")

    from toolkit.rank_pool import get_pool

    shapes = ([small] if small else []) + [args.size]
    pool = get_pool(n, timeout=300.0)
    start = time.perf_counter()
    try:
        per_rank = pool.run(worker, shapes, args.reps, args.warmup, args.seed)
    finally:
        pool.close()
    elapsed = time.perf_counter() - start

    print(f"same-placement boxing, {n} gloo ranks (CPU, 1 thread each), fp32; "
          f"max over ranks of per-rank median of {args.reps} reps; {elapsed:.0f} s")
    print("ours = x.to_global(sbp=dst) under no_grad; grad = same with autograd recording; "
          "bare = torch.distributed calls; DTensor = redistribute under no_grad\n")
    if small:
        print_table(f"per-call overhead, {small[0]}x{small[1]} fp32 ({small[0] * small[1] * 4} B):",
                    summarise(per_rank, small, PAIRS))
    mb = args.size[0] * args.size[1] * 4 / 2**20
    wb, wbp, wd, wdp, wl, wlp, floor = print_table(f"{args.size[0]}x{args.size[1]} fp32 ({mb:.1f} MiB):",
                                            summarise(per_rank, args.size, PAIRS))
    fmt = lambda p: f"{p[0]} -> {p[1]}" if p else "-"  # noqa: E731
    print(f"worst ours/bare with a collective: {wb:.2f}x ({fmt(wbp)}); local-only pairs: {wl:.2f}x "
          f"({fmt(wlp)}); ours/DTensor: {wd:.2f}x ({fmt(wdp)})")
    print(f"boxing vs bare (worst): {max(wb, wl):.2f}x ({fmt(wlp if wl > wb else wbp)}), with a collective "
          f"{wb:.2f}x; vs DTensor (worst): {wd:.2f}x; noise floor (bare'/bare, worst): {floor:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
