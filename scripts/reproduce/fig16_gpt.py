"""OneFlow Fig 16 / LiBai's table: GPT-2 throughput over dp/tp/pp configurations vs Megatron-style baselines.

The paper trains GPT with data, tensor and pipeline parallelism on GPU
clusters against Megatron-LM (LiBai's table: samples/s per configuration).
Here ``scripts/bench_gpt.py`` measures, on local gloo ranks of this
machine, the tiny GPT-2 trained by our trainer (actors, our data path
included) against the PyTorch-native peer of each layout on the same
batches: dp2 vs DDP, tp2 vs DTensor tensor parallel, pp2 vs
``torch.distributed.pipelining`` 1F1B, one process vs eager torch, with
the same losses step after step.

At paper scale it predicts, with the auto-parallel simulator
(``simulated.py``: rehearsed stages priced by a cluster preset's roofline,
the runtime's task graph simulated), LiBai's GPT-2 configuration
(``gpt2-medium``: 24 layers, hidden 1024, 16 heads; bf16, activation
checkpointing, global batch 256) over dp/tp/pp layouts of 32 devices on
``configs/cluster`` presets (4 nodes of 8 V100s or H100s): samples/s and
peak memory per device. Those rows are ours only — the simulator models
our runtime, not Megatron — and are marked ``predicted``.
"""
from __future__ import annotations

import time

from .simulated import evaluator, gpt_model, gpt_overrides, load_cluster, strategy
from .writer import Result

TITLE = "OneFlow Fig 16 / LiBai: GPT-2 throughput over dp/tp/pp layouts vs DDP, DTensor TP, torch pipelining"
COLUMNS = ["source", "cluster", "layout", "variant", "devices", "step_ms", "samples_per_s", "tokens_per_s", "cpu_ms",
           "peak_mib", "ours_vs_peer", "loss_rel_diff"]
DEVICES = {"dp2": 2, "tp2": 2, "pp2": 2, "single": 1}
PREDICTED = "dp32,dp8_tp4,dp4_tp8,dp8_pp4,dp4_tp2_pp4"
QUICK = {"only": "dp2,single", "steps": 2, "predict_model": "gpt2-tiny", "predict_layouts": "dp8_tp4,dp8_pp4"}
MIB = 2 ** 20


def add_arguments(ap) -> None:
    ap.add_argument("--only", default="dp2,tp2,pp2,single", help="layouts measured here (subset of dp2,tp2,pp2,single)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--clusters", default="v100_4x8,h100_4x8", help="cluster presets for the predictions")
    ap.add_argument("--predict-model", default="gpt2-medium", help="model preset predicted at paper scale")
    ap.add_argument("--predict-layouts", default=PREDICTED, help="layouts of all the cluster's devices ('' = none)")
    ap.add_argument("--predict-batch", type=int, default=256, help="global batch (sequences) predicted")
    ap.add_argument("--predict-micro", type=int, default=8, help="rows per micro-batch predicted")


def measured_rows(data: dict) -> list:
    rows = []
    for layout, res in data["results"].items():
        for side in ("ours", "theirs"):
            r = res[side]
            rows.append({"source": "measured", "cluster": "this machine", "layout": layout,
                         "variant": "ours" if side == "ours" else data["peers"][layout], "devices": DEVICES[layout],
                         "step_ms": r["step_s"] * 1e3, "samples_per_s": data["setting"]["batch"] / r["step_s"],
                         "tokens_per_s": r["tok_s"], "cpu_ms": r["cpu_s"] * 1e3,
                         "peak_mib": r["peak"], "ours_vs_peer": res["ratio"] if side == "ours" else None,
                         "loss_rel_diff": res["loss_diff"] if side == "ours" else None})
    return rows


def predicted_rows(args, clusters: list) -> tuple:
    """``(rows, notes)``: each layout of ``--predict-layouts`` simulated on each cluster (one rehearsal for all)."""
    layouts = [x for x in args.predict_layouts.split(",") if x]
    if not layouts:
        return [], []
    model = gpt_model(gpt_overrides(args.predict_model, args.predict_batch, args.predict_micro))
    seq = int(model.cfg.data.seq_len)
    evaluators = [evaluator(model, c) for c in clusters]
    rows, notes = [], []
    for layout in layouts:
        s = strategy(layout, args.predict_micro)
        problems = model.problems(s)
        if problems:
            notes.append(f"{layout}: not predicted ({problems[0]})")
            continue
        t0 = time.perf_counter()
        for cluster, ev in zip(clusters, evaluators):
            if s.world != cluster.devices:
                notes.append(f"{layout}: not predicted on {cluster.name} ({s.world} devices, the cluster has "
                             f"{cluster.devices})")
                continue
            p = ev.predict(s)
            rows.append({"source": "predicted", "cluster": cluster.name, "layout": layout,
                         "variant": "ours (simulated)" if p.fits else "ours (simulated, out of memory)",
                         "devices": s.world, "step_ms": p.step_seconds * 1e3,
                         "samples_per_s": args.predict_batch / p.step_seconds,
                         "tokens_per_s": args.predict_batch * seq / p.step_seconds, "peak_mib": p.peak_memory / MIB})
        print(f"  predicted {layout} on {', '.join(c.name for c in clusters)} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    for cluster in clusters:
        mine = [r for r in rows if r["cluster"] == cluster.name and "out of memory" not in r["variant"]]
        if mine:
            best = max(mine, key=lambda r: r["samples_per_s"])
            notes.append(f"predicted best on {cluster.name}: {best['layout']} {best['samples_per_s']:.1f} samples/s")
    return rows, notes


def reproduce(args, bench) -> Result:
    clusters = [load_cluster(c) for c in args.clusters.split(",") if c]  # a bad preset fails before any run
    data = bench.run("bench_gpt", ["--only", args.only, "--seq", args.seq, "--batch", args.batch, "--micro",
                                   args.micro, "--steps", args.steps, "--warmup", args.warmup])
    rows = measured_rows(data)
    notes = [f"{layout}: ours / {data['peers'][layout]} {res['ratio']:.2f}x tokens/s ({res['cpu_ratio']:.2f}x by CPU "
             f"time), {res['mem_ratio']:.2f}x peak memory; loss max rel diff {res['loss_diff']:.1e}"
             for layout, res in data["results"].items()]
    single = data["results"].get("single")
    if single:
        notes.append(f"single process: ours {single['ours']['mfu'] * 100:.1f}% MFU, eager torch "
                     f"{single['theirs']['mfu'] * 100:.1f}% (of {single['peak'] * 1e3:.1f} GFLOP/s measured on one thread)")
    predicted, more = predicted_rows(args, clusters)
    rows += predicted
    notes += more
    measured = (f"gpt2-tiny (4 layers, n_embd 128, vocab 8192), {args.batch} sequences of {args.seq} tokens a step, "
                f"micro-batches of {args.micro} rows per rank, fp32 AdamW, on local gloo ranks; median of {args.steps} "
                "timed steps alternating ours and the peer (max over ranks); peak = C heap per rank")
    simulated = "nothing"
    if predicted:
        simulated = (f"{args.predict_model} (vocabulary 50304, bf16, activation checkpointing), global batch "
                     f"{args.predict_batch}, micro-batches of {args.predict_micro}, on {args.clusters} (roofline "
                     "costs of the data sheets): our runtime's step simulated from rehearsed stages; no peer simulated")
    return Result("fig16", TITLE, COLUMNS, rows, measured, simulated=simulated, notes=notes, plot=plot)


def plot(result: Result, plt):
    rows = [r for r in result.rows if r["source"] == "measured"]
    predicted = [r for r in result.rows if r["source"] == "predicted"]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, 3 if predicted else 2, figsize=(15 if predicted else 10, 3.8))
    thr, mem = axes[0], axes[1]
    width = 0.38
    for i, layout in enumerate(layouts):
        ours, peer = [r for r in rows if r["layout"] == layout]
        for ax, key in ((thr, "tokens_per_s"), (mem, "peak_mib")):
            ax.bar(i - width / 2, ours[key], width, color="tab:blue", label="ours" if i == 0 else None)
            ax.bar(i + width / 2, peer[key], width, color="tab:orange", label="PyTorch peer" if i == 0 else None)
        thr.text(i, max(ours["tokens_per_s"], peer["tokens_per_s"]), f"{ours['ours_vs_peer']:.2f}x\nvs {peer['variant']}",
                 ha="center", va="bottom", fontsize=7)
    for ax, label in ((thr, "tokens/s (measured, this machine)"), (mem, "peak MiB per rank (measured)")):
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    thr.set_ylim(0, thr.get_ylim()[1] * 1.2)
    if predicted:
        _plot_predicted(axes[2], predicted)
    return fig


def _plot_predicted(ax, rows: list) -> None:
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    width = 0.8 / len(clusters)
    for j, cluster in enumerate(clusters):
        got = {r["layout"]: r for r in rows if r["cluster"] == cluster}
        for i, layout in enumerate(layouts):
            if layout in got:
                r = got[layout]
                ax.bar(i - 0.4 + width * (j + 0.5), r["samples_per_s"], width, color=f"C{j}",
                       hatch="//" if "memory" in r["variant"] else None, label=cluster if i == 0 else None)
    ax.set_xticks(range(len(layouts)), layouts, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("samples/s (predicted, simulator)")
    ax.set_title("paper scale: ours, simulated (hatched: out of memory)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
