"""Where the host time of an op on global tensors goes: cProfile of a tp2 GPT-2 step and of the op chain.

    python scripts/profile_hot_path.py [--steps 5] [--top 12]

On a 2-rank gloo pool (CPU), rank 0 profiles with ``cProfile``:

- the tiny GPT-2 of ``scripts/verify_parity.py`` under the Megatron plan
  (``GPT_TP`` + ``GPT_TP_PINS``, the model and batch of ``bench_dispatch``'s tp2
  step) for ``--steps`` forward + backward + AdamW steps after two warm-up steps;
- ``bench_dispatch``'s op chain (``OPS``, layout ``S0``) under ``no_grad``, 200
  calls of each op after warm-up (every call a decision-cache hit).

For each it prints the functions with the most own time (``tottime``) and
that time grouped by where the function lives: ``sbp_core`` (our dispatch,
boxing, autograd wrappers), ``torch`` (its Python: autograd Function,
optimizer, subclass-rule lookup), ``builtin`` (C functions called from
Python: the aten ops on local shards, the wrapper constructor, collectives)
and ``other``. cProfile adds a fixed cost per Python call, so the split
overstates Python-heavy parts; the counts of calls are exact.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch



def _where(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<built-in") or filename.startswith("<method"):
        return "builtin"
    if f"{os.sep}sbp_core{os.sep}" in filename:
        return "sbp_core"
    if f"{os.sep}torch{os.sep}" in filename:
        return "torch"
    return "other"


def _summary(prof: cProfile.Profile, top: int, per: int) -> list:
    """Lines: own time by package, then the ``top`` functions by own time (us per ``per`` units)."""
    st = pstats.Stats(prof)
    groups, rows = {}, []
    for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        where = _where(fname)
        groups[where] = groups.get(where, 0.0) + tt
        rows.append((tt, nc, f"{os.path.basename(fname)}:{line}({func})" if where != "builtin" else func, where))
    total = sum(groups.values())
    lines = ["  own time by package: " + ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1]))]
    lines.append(f"  {'us/unit':>8s} {'calls/unit':>10s}  function")
    for tt, nc, name, where in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {tt / per * 1e6:8.1f} {nc / per:10.1f}  {name} [{where}]")
    return lines


def worker(steps: int, top: int) -> list:
    import torch.distributed as dist

    import sbp_core as sc
    from recipes.gpt2.model import GPT2LMHeadModel
    from sbp_core import sbp
    from benchkit.dtensor_gpt import OPS, _inputs
    from benchkit.parity import GPT_CFG, GPT_TP, GPT_TP_PINS

    n, me = dist.get_world_size(), dist.get_rank()
    p = sc.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT_CFG)
    sc.distribute_module(model, p, {**GPT_TP, **GPT_TP_PINS})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, GPT_CFG.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    gids = sc.distribute(ids, p, sbp.broadcast)

    def step():
        loss = model(gids, gids)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = [f"tp2 GPT-2 step (rank {me}), per step:"] + _summary(prof, top, steps)

    full = _inputs()
    xs = [sc.distribute(t, p, sbp.split(0) if i == 0 else sbp.broadcast) for i, t in enumerate(full)]
    calls = 200
    with torch.no_grad():
        for fn in OPS.values():
            for _ in range(20):
                fn(*xs)
        prof = cProfile.Profile()
        prof.enable()
        for fn in OPS.values():
            for _ in range(calls):
                fn(*xs)
        prof.disable()
    out += ["", f"op chain ({len(OPS)} ops of bench_dispatch, S0, no_grad; rank {me}), per op call:"]
    out += _summary(prof, top, calls * len(OPS))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        ap.error(f"--steps and --top must be >= 1, got {args.steps}, {args.top}")
    from toolkit.rank_pool import get_pool

    pool = get_pool(2, timeout=300.0)
    try:
        lines = pool.run(worker, args.steps, args.top)[0]
    finally:
        pool.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
