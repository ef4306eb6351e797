"""OneFlow Fig 12 / InsightFace's README table: model-parallel FC vs data parallel as the identities grow.

The paper (and InsightFace's Partial FC table) trains face recognition with
millions of identities: data parallelism replicates the FC layer and runs
out of memory first; splitting the class centres over the devices (and
sampling them, Partial FC) keeps memory per device and throughput flat.
Here ``scripts/bench_insightface.py`` measures on local gloo ranks (CPU) a
small iResNet-18 with an ArcFace head over C identities: DDP with the FC
replicated, our class-split FC (``recipes/insightface/plan.py``) and
Partial FC 0.1; per-rank peak heap and images/s for each C, and the
largest C each fits in a per-rank budget (linear fit of the measured
memory). Measured only; the memory columns are what scales to a cluster
(they are per-rank bytes), the throughput shares 2 cores between the ranks.
"""
from __future__ import annotations

from .writer import Result

TITLE = "OneFlow Fig 12 / InsightFace: model-parallel FC vs data parallel, memory and throughput vs identities"
COLUMNS = ["classes", "kind", "peak_mib", "images_per_s", "status"]
KIND_NAMES = {"ddp": "DDP (FC replicated)", "mp": "ours: class-split FC", "pfc": "ours: Partial FC 0.1"}
MIB = 2 ** 20
QUICK = {"classes": "10000,100000", "steps": 1, "batch": 32, "rounds": 1}


def add_arguments(ap) -> None:
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--classes", default="10000,100000,300000,1000000", help="comma-separated identity counts")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per point (median)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (images)")
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="per-rank memory budget")
    ap.add_argument("--rounds", type=int, default=3, help="back-to-back rounds of the kinds at each count")


def reproduce(args, bench) -> Result:
    data = bench.run("bench_insightface", ["--ranks", args.ranks, "--classes", args.classes, "--steps", args.steps,
                                           "--batch", args.batch, "--budget-mib", args.budget_mib,
                                           "--rounds", args.rounds])
    rows = [{"classes": r["classes"], "kind": KIND_NAMES[r["kind"]],
             "peak_mib": None if r["peak_bytes"] is None else r["peak_bytes"] / MIB, "images_per_s": r["images_per_s"],
             "status": "measured" if r["peak_bytes"] is not None else "over budget (predicted, not run)"}
            for r in data["rows"]]
    most = data["predicted_max_classes"]
    notes = ["predicted, not run: the largest identity count within the budget, from a linear fit of the measured "
             "memory: " + "; ".join(f"{KIND_NAMES[k]} {v:,}" if v else f"{KIND_NAMES[k]} ?" for k, v in most.items())]
    both = sorted({r["classes"] for r in data["rows"] if r["kind"] == "ddp" and r["peak_bytes"] is not None}
                  & {r["classes"] for r in data["rows"] if r["kind"] == "mp" and r["peak_bytes"] is not None})
    for c in both:  # every identity count both ran, not only the one that favours either
        at = {r["kind"]: r for r in data["rows"] if r["classes"] == c}
        notes.append(f"at {c:,} identities, class-split FC vs DDP: memory "
                     f"{at['mp']['peak_bytes'] / at['ddp']['peak_bytes']:.2f}x, throughput "
                     f"{at['mp']['images_per_s'] / at['ddp']['images_per_s']:.2f}x")
    measured = (f"iResNet-18 (width 8, 32x32, 128-d, ArcFace) on {args.ranks} local gloo ranks, global batch "
                f"{args.batch}, SGD momentum: per-rank peak C heap (worst rank) and images/s (median of {args.steps} "
                f"steps of the worst rank, median of the rounds) for each identity count; budget "
                f"{args.budget_mib:.0f} MiB per rank")
    result = Result("fig12", TITLE, COLUMNS, rows, measured,
                    simulated="nothing (per-rank memory is measured exactly; the ranks share this machine's cores)",
                    notes=notes, plot=plot)
    result.meta["budget_mib"] = args.budget_mib
    return result


def plot(result: Result, plt):
    fig, (mem, thr) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind in KIND_NAMES.values():
        pts = [r for r in result.rows if r["kind"] == kind and r["peak_mib"] is not None]
        mem.plot([r["classes"] for r in pts], [r["peak_mib"] for r in pts], marker="o", label=kind)
        thr.plot([r["classes"] for r in pts], [r["images_per_s"] for r in pts], marker="o", label=kind)
    mem.axhline(result.meta["budget_mib"], color="black", linestyle="--", linewidth=0.8, label="budget per rank")
    for ax, label in ((mem, "peak MiB per rank"), (thr, "images/s")):
        ax.set_xscale("log")
        ax.set_xlabel("identities (classes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    mem.set_yscale("log")
    mem.legend(fontsize=7)
    return fig
