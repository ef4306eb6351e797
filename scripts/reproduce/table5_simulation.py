"""FlexFlow Table 5: simulation time of per-op strategy changes, full vs delta, on 1, 2 and 4 nodes.

FlexFlow's Table 5 times its MCMC strategy search for several DNNs on 1, 2
and 4 nodes with every proposal simulated from scratch (full) and only
from the first task the proposal changes (delta): delta is 2-7x faster
and finds the same strategy. A search proposal of that kind changes one
op's layout; here the same proposals (``--changes`` random per-layer op
layouts, FlexFlow's move, drawn from the search model's choices with a
fixed seed) are applied to GPT-2 ``dp2_tp4_pp1/2/4`` — 8, 16 and 32 devices,
the first 1, 2 and 4 nodes of a cluster preset — and each is predicted by
the auto-parallel simulator (``toolkit.search.evaluate``) both ways:
``predict(s)`` (every stage priced, the whole task graph simulated) and
``predict(s, base=unchanged)`` (the unchanged stages' works reused, the
graph re-simulated from the last snapshot before the changed stage first
acts), which is what the search (``toolkit.search.mcmc``) does for an op
move. Stage rehearsals are done before the clock starts (their time is
shown apart, ``rehearse_s``), so both sides price the same traces; the two
timelines must be identical (checked: ``identical``). Simulated only: no
training step runs; the times are this machine's wall time of the
simulator, the quantity of FlexFlow's table.
"""
from __future__ import annotations

import time

from .simulated import evaluator, gpt_model, gpt_overrides, load_cluster, strategy
from .writer import Result

TITLE = "FlexFlow Table 5: simulation time of per-op layout changes, full vs delta (GPT-2, 1/2/4 nodes)"
COLUMNS = ["model", "cluster", "devices", "layout", "micro_batches", "tasks", "changes", "full_ms", "delta_ms",
           "speedup", "identical", "rehearse_s"]
QUICK = {"nodes": "1,2", "changes": 4, "repeats": 2}


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="gpt2-tiny", help="model preset (configs/model)")
    ap.add_argument("--cluster", default="v100_4x8", help="cluster preset (configs/cluster, roofline costs)")
    ap.add_argument("--nodes", default="1,2,4", help="comma-separated node counts: pipeline stages of dp2_tp4")
    ap.add_argument("--changes", type=int, default=8, help="random per-op layout changes predicted both ways")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed full/delta predictions per change (fastest)")


def _fastest(fn, repeats: int):
    best, got = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = fn()
        best = min(best, time.perf_counter() - t0)
    return best, got


def measure(model, cluster, layout: str, args) -> dict:
    """One row: rehearse the base and its changes, then time each change's full and delta prediction."""
    ev = evaluator(model, cluster)
    base_s = strategy(layout, args.micro)
    t0 = time.perf_counter()
    base = ev.predict(base_s)
    todo = model.op_changes(base_s, args.changes)
    rehearse_s = time.perf_counter() - t0
    full_t = delta_t = 0.0
    identical = True
    for s in todo:
        tf, full = _fastest(lambda s=s: ev.predict(s), args.repeats)
        td, delta = _fastest(lambda s=s: ev.predict(s, base=base), args.repeats)
        identical &= full.timeline.tasks == delta.timeline.tasks and full.step_seconds == delta.step_seconds
        full_t, delta_t = full_t + tf, delta_t + td
    n = len(todo)
    return {"model": args.model, "cluster": cluster.name, "devices": cluster.devices, "layout": layout,
            "micro_batches": model.micro_batches(base_s), "tasks": len(base.timeline.tasks), "changes": n,
            "full_ms": full_t / n * 1e3, "delta_ms": delta_t / n * 1e3, "speedup": full_t / delta_t,
            "identical": identical, "rehearse_s": rehearse_s}


def reproduce(args, bench) -> Result:
    nodes = [int(n) for n in str(args.nodes).split(",") if n]
    clusters = [load_cluster(args.cluster, n) for n in nodes]  # bad names and node counts fail before any work
    model = gpt_model(gpt_overrides(args.model, args.global_batch, args.micro, args.seq), per_layer=True)
    rows = []
    for cluster in clusters:
        layout = f"dp2_tp{cluster.devices // (2 * cluster.nodes)}_pp{cluster.nodes}"
        print(f"  {args.model} {layout} on {cluster.name}: rehearsing, then {args.changes} changes both ways",
              flush=True)
        rows.append(measure(model, cluster, layout, args))
    notes = [f"{r['layout']} ({r['devices']} devices, {r['tasks']} simulated tasks): delta {r['speedup']:.2f}x "
             f"faster than full per change; identical timelines: {'yes' if r['identical'] else 'NO'}" for r in rows]
    notes.append("FlexFlow (Table 5, end-to-end search on 1/2/4 nodes of P100s): delta 2.2x-6.9x faster than full")
    simulated = (f"{args.model} (global batch {args.global_batch} x {args.seq} tokens, micro-batches of {args.micro}, "
                 f"bf16) on the first {'/'.join(map(str, nodes))} nodes of {args.cluster} (roofline costs): "
                 f"{args.changes} random per-layer op-layout changes of dp2_tp4_ppN, each predicted with full and with "
                 f"delta simulation; time per change = fastest of {args.repeats}, mean over the changes")
    return Result("table5", TITLE, COLUMNS, rows,
                  measured="the simulator's wall time on this machine (the quantity FlexFlow's table reports)",
                  simulated=simulated, notes=notes, plot=plot)


def plot(result: Result, plt):
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['layout']}\n{r['devices']} devices" for r in result.rows]
    x = range(len(result.rows))
    ax.bar([i - 0.2 for i in x], [r["full_ms"] for r in result.rows], 0.4, label="full simulation")
    ax.bar([i + 0.2 for i in x], [r["delta_ms"] for r in result.rows], 0.4, label="delta simulation")
    for i, r in zip(x, result.rows):
        ax.text(i, max(r["full_ms"], r["delta_ms"]), f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per per-op change (simulator)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig
