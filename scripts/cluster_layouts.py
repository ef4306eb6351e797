"""Predicted GPT training throughput per layout on modelled clusters (``configs/cluster``), no GPU needed.

    python scripts/cluster_layouts.py [--clusters v100_4x8,h100_4x8] [--model gpt2-medium]
                                      [--global-batch 256] [--micro 8] [--png docs/figures/cluster_layouts.png]

For each cluster the GPT-2 recipe with ``--model`` (default ``gpt2-medium``:
24 layers, 16 heads, hidden 1024 — LiBai's ``nl24_nah16_hs1024`` — with
the vocabulary padded to 50304 as Megatron does, sequences of 1024 tokens,
bf16, activation checkpointing) is rehearsed stage by stage
(``toolkit.search``; deep stages priced from 2- and 3-layer rehearsals) and
priced by the roofline of the cluster's devices and links; the task graph of
one step is simulated. Two tables:

1. **LiBai-shaped** GPT configuration table: one row per ``dp x tp x pp`` of
   all the cluster's devices (named like LiBai's benchmark rows), predicted
   samples/s, step time and peak memory per device.
2. **Megatron's finding**: with pp = 1, throughput by tensor-parallel size;
   the claim checked is that the best tp is at most the devices of a node
   and that every tp beyond a node is slower than tp = devices per node.

A PNG shows predicted samples/s per layout for every cluster. Prints a last
line per cluster: ``<cluster>: best <layout> <samples/s>; Megatron tp<=node: holds|FAILS``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

LAYOUTS = ("dp32 dp16_tp2 dp8_tp4 dp4_tp8 dp2_tp16 tp32 dp16_pp2 dp8_pp4 dp8_tp2_pp2 dp4_tp2_pp4 dp4_tp4_pp2 "
           "dp2_tp8_pp2 dp2_tp4_pp4 dp4_tp8_zero1")


def _layouts(devices: int) -> list:
    """The default layouts scaled to ``devices`` (written for 32)."""
    from toolkit.config import parallel_name, parse_parallel_name

    out = []
    for name in LAYOUTS.split():
        d = parse_parallel_name(name)
        scale = devices / (d["dp"] * d["tp"] * d["pp"])
        if d["dp"] * scale >= 1 and float(d["dp"] * scale).is_integer():
            out.append(parallel_name(int(d["dp"] * scale), d["tp"], d["pp"], d["zero"]))
    return list(dict.fromkeys(out))


def predict_layouts(cluster_name: str, overrides: list, micro: int, log=print) -> tuple:
    from recipes.registry import get
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.opcost import RooflineOpCosts
    from toolkit.search.strategy import Strategy
    from toolkit.search.cluster_file import load_cluster
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.config import compose, parse_parallel_name

    cluster = load_cluster(cluster_name)
    cfg = compose(overrides, run_dir="/tmp/cluster_layouts")
    model = RecipeSearchModel(get(cfg.recipe.name), cfg, per_layer=False)
    ev = Evaluator(model, cluster, RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth, cluster.kernel_overhead))
    rows = []
    for name in _layouts(cluster.devices):
        d = parse_parallel_name(name)
        s = Strategy(d["dp"], d["tp"], d["pp"], d["zero"], micro_batch_size=micro)
        problems = model.problems(s)
        if problems:
            log(f"  {name}: skipped ({problems[0]})")
            continue
        t0 = time.time()
        p = ev.predict(s)
        rows.append((s, p))
        log(f"  {name}: {model.global_batch / p.step_seconds:8.1f} samples/s, {p.peak_memory / 2**30:5.1f} GiB "
            f"({time.time() - t0:.0f} s)")
    return cluster, model, rows


def libai_name(cfg_model, s, micro: int, gb: int, cluster) -> str:
    return (f"gpt2_nl{cfg_model.n_layer}_nah{cfg_model.n_head}_hs{cfg_model.n_embd}_bf16_actrue_dp{s.dp}_mp{s.tp}_"
            f"pp{s.pp}{'_zero%d' % s.zero if s.zero else ''}_mb{micro}_gb{gb}_{cluster.nodes}n{cluster.devices_per_node}g")


def tables(cluster, model, rows, micro: int) -> tuple:
    gb = model.global_batch
    print(f"\n### {cluster.name}: {cluster.nodes} x {cluster.devices_per_node} devices "
          f"({cluster.source.rsplit('/', 1)[-1]}), GPT-2 nl{model.cfg.model.n_layer} hs{model.cfg.model.n_embd}, "
          f"seq {model.cfg.data.seq_len}, global batch {gb}\n")
    print("| configuration | dp | tp | pp | zero | micro-batches | samples/s | step s | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s, p in rows:
        print(f"| {libai_name(model.cfg.model, s, micro, gb, cluster)} | {s.dp} | {s.tp} | {s.pp} | {s.zero} | "
              f"{model.micro_batches(s)} | {gb / p.step_seconds:.1f} | {p.step_seconds:.3f} | "
              f"{p.peak_memory / 2**30:.1f} | {'yes' if p.fits else 'NO'} |")
    flat = sorted(((s, p) for s, p in rows if s.pp == 1 and s.zero == 0), key=lambda r: r[0].tp)
    print(f"\nMegatron's finding on {cluster.name} (pp = 1): samples/s by tensor-parallel size\n")
    print("| tp | dp | tp group spans | samples/s | vs tp=%d |" % cluster.devices_per_node)
    print("|---|---|---|---|---|")
    ref = next((gb / p.step_seconds for s, p in flat if s.tp == cluster.devices_per_node), None)
    for s, p in flat:
        span = "one node" if s.tp <= cluster.devices_per_node else f"{s.tp // cluster.devices_per_node} nodes"
        rel = f"{(gb / p.step_seconds) / ref:.2f}x" if ref else "-"
        print(f"| {s.tp} | {s.dp} | {span} | {gb / p.step_seconds:.1f} | {rel} |")
    fitting = [(s, p) for s, p in flat if p.fits]
    best = max(fitting, key=lambda r: -r[1].step_seconds)[0] if fitting else None
    beyond = [p for s, p in flat if s.tp > cluster.devices_per_node]
    at_node = [p for s, p in flat if s.tp == cluster.devices_per_node]
    holds = (best is not None and best.tp <= cluster.devices_per_node and at_node
             and all(p.step_seconds > at_node[0].step_seconds for p in beyond))
    overall = min((r for r in rows if r[1].fits), key=lambda r: r[1].step_seconds, default=None)
    return holds, overall


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.6 * len(results)), squeeze=False)
    for ax, (cluster, model, rows) in zip(axes[:, 0], results):
        names = [s.name.replace("_zero", "\nzero") for s, _ in rows]
        vals = [model.global_batch / p.step_seconds for _, p in rows]
        colors = ["tab:red" if not p.fits else "tab:orange" if s.tp > cluster.devices_per_node else "tab:blue"
                  for s, p in rows]
        ax.bar(range(len(rows)), vals, color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("predicted samples/s")
        ax.set_title(f"{cluster.name}: GPT-2 nl{model.cfg.model.n_layer} hs{model.cfg.model.n_embd}, "
                     f"global batch {model.global_batch} (orange: tp beyond a node, red: out of memory)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="v100_4x8,h100_4x8")
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--png", default="docs/figures/cluster_layouts.png")
    o = ap.parse_args()
    overrides = [f"model={o.model}", "model.vocab_size=50304", "trainer.precision=bf16",
                 "trainer.activation_checkpointing=true", f"trainer.global_batch_size={o.global_batch}",
                 f"trainer.micro_batch_size={o.micro}", "trainer.eval_every=0"]
    results, lines = [], []
    for name in o.clusters.split(","):
        print(f"{name}:")
        cluster, model, rows = predict_layouts(name, overrides, o.micro)
        holds, best = tables(cluster, model, rows, o.micro)
        results.append((cluster, model, rows))
        lines.append(f"{cluster.name}: best {best[0].name} {model.global_batch / best[1].step_seconds:.1f} samples/s; "
                     f"Megatron tp<=node: {'holds' if holds else 'FAILS'}")
    plot(results, o.png)
    print(f"\nplot: {o.png}")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
