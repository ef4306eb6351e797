"""OneFlow Fig 16 / LiBai's table: GPT-2 throughput over dp/tp/pp configurations vs Megatron-style baselines.

The paper trains GPT with data, tensor and pipeline parallelism on GPU
clusters against Megatron-LM (LiBai's table: samples/s per configuration).
Here ``scripts/bench_gpt.py`` measures, on local gloo ranks of this
machine, the tiny GPT-2 trained by our trainer (actors, our data path
included) against the PyTorch-native peer of each layout on the same
batches: dp2 vs DDP, tp2 vs DTensor tensor parallel, pp2 vs
``torch.distributed.pipelining`` 1F1B, one process vs eager torch, with
the same losses step after step.
"""
from __future__ import annotations

from .writer import Result

TITLE = "OneFlow Fig 16 / LiBai: GPT-2 throughput over dp/tp/pp layouts vs DDP, DTensor TP, torch pipelining"
COLUMNS = ["source", "cluster", "layout", "variant", "devices", "step_ms", "tokens_per_s", "cpu_ms", "peak_mib",
           "ours_vs_peer", "loss_rel_diff"]
DEVICES = {"dp2": 2, "tp2": 2, "pp2": 2, "single": 1}


def add_arguments(ap) -> None:
    ap.add_argument("--only", default="dp2,tp2,pp2,single", help="layouts measured here (subset of dp2,tp2,pp2,single)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant (median)")
    ap.add_argument("--warmup", type=int, default=1)


def measured_rows(data: dict) -> list:
    rows = []
    for layout, res in data["results"].items():
        for side in ("ours", "theirs"):
            r = res[side]
            rows.append({"source": "measured", "cluster": "this machine", "layout": layout,
                         "variant": "ours" if side == "ours" else data["peers"][layout], "devices": DEVICES[layout],
                         "step_ms": r["step_s"] * 1e3, "tokens_per_s": r["tok_s"], "cpu_ms": r["cpu_s"] * 1e3,
                         "peak_mib": r["peak"], "ours_vs_peer": res["ratio"] if side == "ours" else None,
                         "loss_rel_diff": res["loss_diff"] if side == "ours" else None})
    return rows


def reproduce(args, bench) -> Result:
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
    measured = (f"gpt2-tiny (4 layers, n_embd 128, vocab 8192), {args.batch} sequences of {args.seq} tokens a step, "
                f"micro-batches of {args.micro} rows per rank, fp32 AdamW, on local gloo ranks; median of {args.steps} "
                "timed steps alternating ours and the peer (max over ranks); peak = C heap per rank")
    return Result("fig16", TITLE, COLUMNS, rows, measured,
                  simulated="nothing yet: paper-scale predictions need the auto-parallel simulator (branch autoparallel)",
                  notes=notes, plot=plot)


def plot(result: Result, plt):
    rows = [r for r in result.rows if r["source"] == "measured"]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, (thr, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.38
    for i, layout in enumerate(layouts):
        ours, peer = [r for r in rows if r["layout"] == layout]
        for ax, key in ((thr, "tokens_per_s"), (mem, "peak_mib")):
            ax.bar(i - width / 2, ours[key], width, color="tab:blue", label="ours" if i == 0 else None)
            ax.bar(i + width / 2, peer[key], width, color="tab:orange", label="PyTorch peer" if i == 0 else None)
        thr.text(i, max(ours["tokens_per_s"], peer["tokens_per_s"]), f"{ours['ours_vs_peer']:.2f}x\nvs {peer['variant']}",
                 ha="center", va="bottom", fontsize=7)
    for ax, label in ((thr, "tokens/s (measured, this machine)"), (mem, "peak MiB per rank")):
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    thr.set_ylim(0, thr.get_ylim()[1] * 1.2)
    return fig
