"""OneFlow Fig 15: ZeRO stages 0-3 as an SBP rewrite, memory and throughput vs DeepSpeed-style baselines.

The paper implements ZeRO in OneFlow as a change of SBP (optimizer states,
gradients, parameters split over data parallel) and compares memory and
throughput with DeepSpeed. Here ``scripts/bench_zero.py`` measures a small
GPT-2 on 4 local gloo ranks: the bytes each rank holds per stage, fp32 and
bf16 compute, against the ZeRO paper's formulas (exact), the bytes sent per
step against 2Ψ/3Ψ·(N-1)/N, and our stage 1 / stage 3 against
``ZeroRedundancyOptimizer`` under DDP (ZeRO-1) and FSDP2 (ZeRO-3), the
peers PyTorch ships. Measured only; the bytes held follow the formulas at
any N and Ψ, so they are the part that carries to a cluster.
"""
from __future__ import annotations

from .writer import Result

TITLE = "OneFlow Fig 15: ZeRO stages, bytes per rank and throughput vs ZeroRedundancyOptimizer and FSDP2"
COLUMNS = ["variant", "stage", "dtype", "params_mib", "grads_mib", "optim_mib", "total_mib", "formula_mib", "exact",
           "sent_mib", "sent_formula_mib", "step_s", "tokens_per_s"]
PARTS = (("params", "params_mib"), ("grads", "grads_mib"), ("optimizer_states", "optim_mib"), ("total", "total_mib"))
MIB = 2 ** 20
QUICK = {"steps": 1}


def add_arguments(ap) -> None:
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="head-to-head rounds against each peer")


def _mib(x):
    return None if x is None else x / MIB


def _row(r: dict, tokens: int) -> dict:
    ours = r["kind"] == "ours"
    row = {"variant": "ours" if ours else r["kind"], "stage": r["stage"], "dtype": r["dtype"],
           **{col: _mib(r["held"][key]) for key, col in PARTS}, "step_s": r["step_s"],
           "tokens_per_s": tokens / r["step_s"]}
    if ours:
        row.update(formula_mib=_mib(r["formula"]["total"]), exact=r["exact"], sent_mib=_mib(r["sent"]),
                   sent_formula_mib=_mib(r["sent_formula"]))
    return row


def reproduce(args, bench) -> Result:
    data = bench.run("bench_zero", ["--steps", args.steps, "--warmup", args.warmup, "--rounds", args.rounds])
    s, tokens = data["setting"], data["setting"]["tokens_per_step"]
    rows = [_row(r, tokens) for r in data["rows"]]
    ours = [r for r in rows if r["variant"] == "ours"]
    notes = [f"bytes held vs the ZeRO paper's formulas: exact for {sum(r['exact'] for r in ours)}/{len(ours)} "
             f"(stage, dtype); Ψ = {s['psi']:,} parameters, N = {s['world']} ranks"]
    for r in data["rows"]:
        if r["kind"] != "ours":
            mine = next(o for o in ours if o["stage"] == r["stage"] and o["dtype"] == "fp32")
            notes.append(f"ours stage {r['stage']} fp32 vs {r['kind']}: memory {mine['total_mib'] / _mib(r['held']['total']):.2f}x, "
                         f"throughput {r['step_s'] / r['ours_step_s']:.2f}x (best median step {r['ours_step_s']:.3f} s "
                         f"vs {r['step_s']:.3f} s)")
    measured = (f"GPT-2 (4 layers, n_embd 128, vocab 512, batch 16x64) on {s['world']} local gloo ranks, AdamW: bytes "
                "of parameters, gradients and optimizer states held by the worst rank after backward (from the "
                "tensors' storages), bytes sent per step (the communication ledger), median step over "
                f"{args.steps} timed steps (ours vs each peer back to back, {args.rounds} round(s))")
    return Result("fig15", TITLE, COLUMNS, rows, measured,
                  simulated="nothing (bytes held are exact per the formulas, which carry to any N and model size)",
                  notes=notes, plot=plot)


def plot(result: Result, plt):
    fig, (mem, thr) = plt.subplots(1, 2, figsize=(11, 4.6))
    short = {"ZeroRedundancyOptimizer": "ZeRO-Opt"}
    labels = [f"{short.get(r['variant'], r['variant'])} s{r['stage']} {r['dtype']}" for r in result.rows]
    bottom = [0.0] * len(result.rows)
    for key, col in PARTS[:3]:
        values = [r[col] for r in result.rows]
        mem.bar(labels, values, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    formula = [r.get("formula_mib") for r in result.rows]
    mem.scatter([lb for lb, f in zip(labels, formula) if f is not None], [f for f in formula if f is not None],
                marker="_", s=400, color="black", label="ZeRO paper formula", zorder=3)
    mem.set_ylabel("MiB held per rank (worst rank)")
    mem.legend(fontsize=7)
    thr.bar(labels, [r["tokens_per_s"] for r in result.rows],
            color=["tab:blue" if r["variant"] == "ours" else "tab:orange" for r in result.rows])
    thr.set_ylabel("tokens/s (median step)")
    for ax in (mem, thr):
        ax.tick_params(axis="x", labelsize=7, labelrotation=45)
        ax.grid(axis="y", alpha=0.3)
    return fig
