"""OneFlow Fig 9: training throughput with data from the actor pipeline vs a torch DataLoader vs synthetic data.

The paper trains with real input pipelines and with synthetic data, and
shows OneFlow's actor-scheduled data loading keeps throughput at the
synthetic level. Here, on this machine, for both inputs the project has:

- GPT token input: ``scripts/bench_dataloader.py`` (a tiny GPT-2 on
  sequences read from a raw token file);
- InsightFace/ResNet image input: ``scripts/bench_dataloader_images.py``
  (an iResNet-18 on JPEG face records, decoded with PIL);

each training from the runtime's data-pipeline actors, from a DataLoader
with 1 and 2 workers, and from the same batches held in memory. Measured
only: the figure is about one process's data path, no cluster to predict.
"""
from __future__ import annotations

from .writer import Result

TITLE = "OneFlow Fig 9: data pipeline throughput vs synthetic data (GPT tokens, face images)"
COLUMNS = ["input", "way", "median_s", "steps_per_s", "items_per_s", "unit", "vs_synthetic", "same_losses"]
INPUTS = ("tokens", "images")
SYNTHETIC = "synthetic (in memory)"
QUICK = {"repeats": 1, "token_steps": 20, "image_steps": 4, "image_size": 64, "identities": 20}


def add_arguments(ap) -> None:
    ap.add_argument("--inputs", default=",".join(INPUTS), help="comma-separated subset of tokens,images")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each way (median)")
    ap.add_argument("--token-steps", type=int, default=60, help="GPT-2 steps per run")
    ap.add_argument("--image-steps", type=int, default=16, help="iResNet steps per run")
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--image-batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=8, help="iResNet-18 base channels")
    ap.add_argument("--identities", type=int, default=100, help="synthetic identities (16 JPEGs each)")


def _rows(label: str, unit: str, data: dict) -> list:
    ref = next(r["steps_per_s"] for r in data["rows"] if r["way"] == SYNTHETIC)
    return [{"input": label, "way": r["way"], "median_s": r["median_s"], "steps_per_s": r["steps_per_s"],
             "items_per_s": r[f"{unit}_per_s"], "unit": unit, "vs_synthetic": r["steps_per_s"] / ref,
             "same_losses": r["same_losses"]} for r in data["rows"]]


def _summary(label: str, rows: list) -> str:
    rate = {r["way"]: r["steps_per_s"] for r in rows if r["input"] == label}
    dl = max(v for k, v in rate.items() if k.startswith("DataLoader"))
    return (f"{label}: actor pipeline / synthetic {rate['actor pipeline'] / rate[SYNTHETIC]:.2f}; "
            f"actor pipeline / best DataLoader {rate['actor pipeline'] / dl:.2f}x")


def reproduce(args, bench) -> Result:
    inputs = [x for x in args.inputs.split(",") if x]
    bad = [x for x in inputs if x not in INPUTS]
    if bad or not inputs:
        raise ValueError(f"--inputs {args.inputs!r}: valid inputs are {', '.join(INPUTS)}")
    rows, what = [], []
    if "tokens" in inputs:
        data = bench.run("bench_dataloader", ["--steps", args.token_steps, "--repeats", args.repeats])
        s = data["setting"]
        rows += _rows("GPT tokens", "tokens", data)
        what.append(f"GPT-2 ({s['n_layer']} layers, batch {s['batch']}x{s['seq']} tokens, {s['steps']} steps)")
    if "images" in inputs:
        data = bench.run("bench_dataloader_images", [
            "--steps", args.image_steps, "--repeats", args.repeats, "--batch", args.image_batch,
            "--image-size", args.image_size, "--width", args.width, "--identities", args.identities])
        s = data["setting"]
        rows += _rows("face images", "images", data)
        what.append(f"iResNet-18 (width {s['width']}, {s['image_size']}x{s['image_size']} JPEG records, "
                    f"batch {s['batch']}, {s['steps']} steps; read+decode+collate "
                    f"{data['load_ms_per_batch']:.1f} ms a batch)")
    measured = ("training throughput of " + " and of ".join(what) + " on one torch thread, data from the runtime's "
                "data-pipeline actors, a DataLoader (1 and 2 workers) or in-memory batches; wall time of the whole "
                f"loop, median of {args.repeats} interleaved runs; same seed, same batches, same losses checked")
    notes = [_summary(label, rows) for label in dict.fromkeys(r["input"] for r in rows)]
    return Result("fig9", TITLE, COLUMNS, rows, measured,
                  simulated="nothing (a single process's data path; the paper's Fig 9 is a one-node measurement)",
                  notes=notes, plot=plot)


def plot(result: Result, plt):
    inputs = list(dict.fromkeys(r["input"] for r in result.rows))
    fig, axes = plt.subplots(1, len(inputs), figsize=(5.5 * len(inputs), 3.6), squeeze=False)
    for ax, label in zip(axes[0], inputs):
        rows = [r for r in result.rows if r["input"] == label]
        ways = [r["way"] for r in rows]
        values = [r["items_per_s"] for r in rows]
        colours = ["tab:blue" if w == "actor pipeline" else "tab:grey" if w == SYNTHETIC else "tab:orange"
                   for w in ways]
        ax.barh(ways, values, color=colours)
        ref = next(r["items_per_s"] for r in rows if r["way"] == SYNTHETIC)
        ax.axvline(ref, color="black", linestyle="--", linewidth=0.8)
        for y, r in enumerate(rows):
            ax.text(r["items_per_s"], y, f" {r['vs_synthetic']:.2f}x", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{rows[0]['unit']}/s (training, one thread)")
        ax.set_title(f"{label} (dashed: synthetic)", fontsize=9)
        ax.set_xlim(0, max(values) * 1.25)
    return fig
