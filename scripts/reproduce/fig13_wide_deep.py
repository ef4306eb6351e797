"""OneFlow Fig 13 / DLPerf: Wide&Deep step latency and memory per device as the vocabulary doubles, on 1/2/4 ranks.

The paper (OneFlow's DLPerf Wide&Deep report) doubles the embedding
vocabulary until a device runs out of memory: with the tables split over
the devices, latency stays flat and the largest vocabulary grows with the
device count, while replicated tables (DDP) hit the wall at the same size
whatever the device count. Here ``scripts/bench_wide_deep.py`` measures
that on local gloo ranks: our plan (wide ``S(0)``, deep ``S(1)`` tables,
lazy Adam) on 1, 2 and 4 ranks vs plain PyTorch (``nn.EmbeddingBag`` +
``SparseAdam``) and DDP on 2 and 4 ranks, doubling V until the per-process
heap budget. Measured only; the budget is scaled down so the sweep ends in
minutes (the memory per row, hence the largest V per budget, is what
carries to a device's memory).
"""
from __future__ import annotations

from .writer import Result

TITLE = "OneFlow Fig 13 / DLPerf: Wide&Deep latency and memory vs vocabulary, 1/2/4 ranks"
COLUMNS = ["series", "vocab_rows", "step_ms", "peak_mib"]
MIB = 2 ** 20
QUICK = {"start": 14, "budget_gib": 0.0625, "hidden": "64x2", "steps": 1, "rounds": 1}


def add_arguments(ap) -> None:
    ap.add_argument("--budget-gib", type=float, default=0.25, help="heap per process (the doubling's wall)")
    ap.add_argument("--start", type=int, default=16, help="first vocabulary = 2**start rows")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--hidden", default="256x3", help="MLP widths (the recipe's default is 1024x7)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="back-to-back rounds of ours vs torch at one V")


def reproduce(args, bench) -> Result:
    data = bench.run("bench_wide_deep", ["--budget-gib", args.budget_gib, "--start", args.start, "--batch",
                                         args.batch, "--hidden", args.hidden, "--steps", args.steps,
                                         "--warmup", args.warmup, "--rounds", args.rounds])
    rows = [{"series": r["series"], "vocab_rows": r["rows"], "step_ms": r["step_s"] * 1e3,
             "peak_mib": r["peak_bytes"] / MIB} for r in data["rows"]]
    most = data["max_rows"]
    notes = ["largest vocabulary within the budget: " + "; ".join(f"{k} {v:,} rows" for k, v in most.items()),
             f"ours 4 ranks / 1 rank: {most['ours4'] / most['ours1']:.1f}x the vocabulary; latency growth per "
             f"doubling {data['growth_pct']:.0f}% (geometric mean, our runs); ours 1 rank vs torch single process "
             f"throughput {data['thr_vs_torch']:.2f}x"]
    measured = (f"one training step (batch {args.batch}, MLP {args.hidden}, 13 dense + 26 categorical fields) "
                f"per vocabulary size; fastest of {args.steps} steps after {args.warmup} warm-up, slowest rank; "
                f"peak C heap of the worst rank; {args.budget_gib} GiB heap budget per process; all ranks on "
                "this machine's cores (compare a series down the vocabulary, not across rank counts)")
    result = Result("fig13", TITLE, COLUMNS, rows, measured,
                    simulated="nothing (per-rank memory is measured; the largest vocabulary is a fit within budget)",
                    notes=notes, plot=plot)
    result.meta["budget_mib"] = data["budget_bytes"] / MIB
    return result


def plot(result: Result, plt):
    fig, (lat, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    for series in dict.fromkeys(r["series"] for r in result.rows):
        pts = sorted((r for r in result.rows if r["series"] == series), key=lambda r: r["vocab_rows"])
        style = "-" if series.startswith("ours") else ":"
        lat.plot([r["vocab_rows"] for r in pts], [r["step_ms"] for r in pts], style, marker="o", label=series)
        mem.plot([r["vocab_rows"] for r in pts], [r["peak_mib"] for r in pts], style, marker="o", label=series)
    mem.axhline(result.meta["budget_mib"], color="black", linestyle="--", linewidth=0.8, label="budget")
    for ax, label in ((lat, "step ms (fastest, slowest rank)"), (mem, "peak MiB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("vocabulary rows")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    lat.set_yscale("log")
    mem.legend(fontsize=7)
    return fig
