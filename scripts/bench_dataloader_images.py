"""Training throughput on JPEG face records from the actor pipeline, a DataLoader, or memory (the image input).

    python scripts/bench_dataloader_images.py [--steps 16] [--batch 32] [--image-size 112] [--width 8]
                                              [--identities 100] [--repeats 3] [--json PATH]

``scripts/bench_dataloader.py``'s comparison for the InsightFace/ResNet
input. The data is the InsightFace recipe's: synthetic identities
JPEG-encoded into an MXNet RecordIO file (``recipes/insightface/data/
synthetic.py``, generated once into ``$SBP_CACHE_DIR`` or
``~/.cache/sbp-recipes``), read through ``FaceRecords`` and
``toolkit.data.MicroBatches`` (shuffled global batches, mirrored rows as
InsightFace's random flip): ``read`` the records' bytes, ``decode`` each
record header and JPEG (PIL), ``collate`` stack and normalise to float32.
An iResNet-18 of ``--width`` channels with an ArcFace head over the
identities trains with SGD (momentum 0.9) for ``--steps`` steps, four ways,
from the same seed over the same batches:

- actor pipeline: the micro-batches' ``stages()`` (read -> decode -> collate
  on the runtime's data queue, 2 registers each; no copy on a CPU-only
  host, so no to_device actor) and the training step as an actor on the
  compute queue;
- DataLoader with 1 and with 2 worker processes, item ``k`` being batch
  ``k`` made by the same read, decode and collate calls (``batch_size=None``);
- synthetic: the same batches decoded into memory beforehand, a plain loop.

The training step runs with ``torch.set_num_threads(1)``, as in
``bench_dataloader.py``, so data loading has the second core to overlap
with. Each time is the whole loop, start-up included, median of
``--repeats`` runs interleaved across the four ways. ``--json PATH`` also
writes the rows as JSON. Last line:
``images: actor pipeline / synthetic: X.XX; vs best DataLoader: Y.YYx``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


from recipes.insightface.data import synthetic as faces
from recipes.insightface.data.face_records import FaceRecords
from recipes.insightface.model import build
from runtime.executor import run
from runtime.plan import ActorSpec, Plan
from toolkit.data import MicroBatches
from toolkit.data.sampler import GlobalBatchSampler

EMB = 128


class Batches(Dataset):
    """``steps`` batches of ``MicroBatches`` as a map-style dataset: item ``k`` is batch ``k`` (read, decode, collate)."""

    def __init__(self, micro: MicroBatches, steps: int):
        self.micro, self.steps = micro, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> dict:
        return self.micro.collate(k, self.micro.decode(k, self.micro.read(k)))


def _trainer(o, classes: int):
    torch.manual_seed(0)
    model = build("iresnet18", o.width, o.image_size, EMB, classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch) -> float:
        loss = model(batch["image"], batch["label"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def actor_pipeline(o, data: Batches, classes: int) -> list:
    step = _trainer(o, classes)
    stages = data.micro.stages(device=None, quota=2)
    plan = Plan(stages + [ActorSpec("train.step", lambda k, batch: step(batch), inputs=(stages[-1].name,),
                                    queue="compute")])
    return run(plan, o.steps, timeout=600).outputs["train.step"]


def dataloader(o, data: Batches, classes: int, workers: int) -> list:
    step = _trainer(o, classes)
    return [step(b) for b in DataLoader(data, batch_size=None, shuffle=False, num_workers=workers, prefetch_factor=2)]


def synthetic(o, batches: list, classes: int) -> list:
    step = _trainer(o, classes)
    return [step(b) for b in batches]


def interleaved(ways: dict, repeats: int) -> tuple:
    """``({way: [seconds per run]}, {way: last run's losses})``; each repeat runs every way once, in turn.

    Repeat ``r`` starts at way ``r`` (mod the ways), so no way always runs
    right after another's (a DataLoader's workers still exiting, a load spike
    on a shared machine) or always first.
    """
    times, losses = {name: [] for name in ways}, {}
    names = list(ways)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = ways[name]
            t = time.perf_counter()
            losses[name] = fn()
            times[name].append(time.perf_counter() - t)
    return times, losses


def measure(o) -> dict:
    """Build (or find) the records, time the four ways; the rows ``main`` prints, and the setting."""
    spec = faces.SyntheticSpec(identities=o.identities, images_per_identity=16, image_size=o.image_size,
                               val_identities=2, val_pairs=2)
    root = faces.ensure(spec, os.environ.get("SBP_CACHE_DIR", "~/.cache/sbp-recipes"))
    source = FaceRecords(root, o.image_size, flip=True)
    data = Batches(MicroBatches(source, GlobalBatchSampler(len(source), o.batch, seed=1)), o.steps)
    t = time.perf_counter()
    batches = [data[k] for k in range(o.steps)]
    load_s = (time.perf_counter() - t) / o.steps  # read + decode + collate of one batch, this thread
    classes = source.num_classes
    ways = {
        "actor pipeline": lambda: actor_pipeline(o, data, classes),
        "DataLoader (1 worker)": lambda: dataloader(o, data, classes, 1),
        "DataLoader (2 workers)": lambda: dataloader(o, data, classes, 2),
        "synthetic (in memory)": lambda: synthetic(o, batches, classes),
    }
    synthetic(o, batches[:2], classes)  # warm up allocator and kernels before any timing
    times, losses = interleaved(ways, o.repeats)
    ref = losses["synthetic (in memory)"]
    rows = [{"way": name, "median_s": statistics.median(times[name]), "min_s": min(times[name]),
             "steps_per_s": o.steps / statistics.median(times[name]),
             "images_per_s": o.steps * o.batch / statistics.median(times[name]), "same_losses": losses[name] == ref}
            for name in ways]
    return {"rows": rows, "load_ms_per_batch": load_s * 1e3, "images": source.n_images, "classes": classes,
            "jpeg_bytes": os.path.getsize(os.path.join(root, "train.rec")) / source.n_images}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="images per step")
    ap.add_argument("--image-size", type=int, default=112, help="pixels (a multiple of 16; InsightFace's 112)")
    ap.add_argument("--width", type=int, default=8, help="iResNet-18 base channels (InsightFace's 64)")
    ap.add_argument("--identities", type=int, default=100, help="synthetic identities, 16 images each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    o = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(o)
    print(f"iResNet-18 width {o.width}, {o.image_size}x{o.image_size} JPEG records ({res['images']} images of "
          f"{res['classes']} identities, {res['jpeg_bytes'] / 1024:.1f} KiB each), batch {o.batch}, {o.steps} steps, "
          f"torch threads 1, median of {o.repeats}, {os.cpu_count()} cores; read+decode+collate "
          f"{res['load_ms_per_batch']:.1f} ms per batch on one thread")
    for r in res["rows"]:
        same = "same losses" if r["same_losses"] else "LOSSES DIFFER"
        print(f"  {r['way']:24s} {r['median_s'] * 1e3:8.1f} ms (min {r['min_s'] * 1e3:7.1f})  "
              f"{r['images_per_s']:6.1f} images/s  ({same} as synthetic)")
    rate = {r["way"]: r["steps_per_s"] for r in res["rows"]}
    best_dl = max(rate["DataLoader (1 worker)"], rate["DataLoader (2 workers)"])
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"setting": vars(o), **res}, f, indent=1)
    print(f"images: actor pipeline / synthetic: {rate['actor pipeline'] / rate['synthetic (in memory)']:.2f}; "
          f"vs best DataLoader: {rate['actor pipeline'] / best_dl:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
