"""Checkpoint save and load, ours against ``torch.distributed.checkpoint`` on the same tensor-parallel model.

    python scripts/bench_checkpoint.py [--repeats 5] [--skip-100m]

Models: gpt2-tiny (``configs/model/gpt2-tiny.yaml``: 4 layers, 128 wide,
8192 tokens, 1.6M parameters) and a ~100M GPT-2 (GPT-2 small's 12 layers of
768 with a 16384-token vocabulary, 98M parameters), fp32 weights, on two
ranks with Megatron's tensor-parallel plan. Every method writes durably
(fsync of every file) and loads into a model that is already built:

- ``ours tp2``: ``toolkit.checkpoint.save``/``load`` of our global tensors
  (each rank writes and reads its own half; raw chunks with a CRC-32 per
  record, checked on load; JSON metadata, manifest, rename and ``latest``);
- ``DCP tp2``: what a DTensor user runs, ``torch.distributed.checkpoint``'s
  ``save``/``load`` with ``FileSystemWriter`` (``sync_files=True``, its
  default) and ``FileSystemReader``, of the same model parallelised by
  ``parallelize_module`` (``benchkit.dtensor_gpt.DTGPT2``, the same
  weights), loaded in place into its DTensors;
- ``torch.save`` (one rank, for reference): rank 0 saves the full state dict
  to one file and fsyncs it, and loads it back with
  ``torch.load(weights_only=True)`` then ``load_state_dict`` into a model.

Each repeat runs every method once, in a rotating order; a method's save and
load times are the medians over repeats of the slowest rank's. Last line:
``save X.XXx, load Y.YYx vs DCP (tp2, ~100M)``: DCP's seconds over ours
(above 1: ours is faster).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


import sbp_core as sc
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from benchkit.parity import GPT_TP
from toolkit import checkpoint as ckpt

MODELS = {
    "gpt2-tiny": dict(vocab_size=8192, n_positions=256, n_embd=128, n_layer=4, n_head=4),
    "gpt2-100m": dict(vocab_size=16384, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
}


def _model(name):
    torch.manual_seed(0)
    cfg = GPT2Config(**MODELS[name], embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("cpu"):
        return GPT2LMHeadModel(cfg)


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _save_fsync(obj, path):
    torch.save(obj, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _timed(fn):
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    return out, dt


class Ours:
    def __init__(self, name, workdir):
        self.model = _model(name)
        sc.distribute_module(self.model, sc.placement("cpu", [0, 1]), GPT_TP)
        self.root, self.step, self.saved = os.path.join(workdir, f"{name}-ours"), 0, None

    def save(self):
        self.step += 1
        self.saved = ckpt.save(self.root, self.step, {"model": self.model.state_dict()}, keep_last=1)

    def load(self):
        ckpt.load(self.saved, {"model": self.model.state_dict()})

    def nbytes(self):
        return _dir_bytes(self.saved)


class DCP:
    def __init__(self, name, workdir):
        from torch.distributed.device_mesh import init_device_mesh

        from benchkit.dtensor_gpt import DTGPT2, _dtensor_tp

        ref = _model(name)
        self.model = DTGPT2(ref.config)
        self.model.load_from(ref)
        _dtensor_tp(self.model, init_device_mesh("cpu", (2,)))
        self.base, self.n, self.path = os.path.join(workdir, f"{name}-dcp"), 0, None

    def save(self):
        import torch.distributed.checkpoint as dcp

        self.n += 1  # a new directory each time, as ours writes step_<n> (DCP warns when it overwrites)
        self.path = f"{self.base}-{self.n}"
        dcp.save(self.model.state_dict(), storage_writer=dcp.FileSystemWriter(self.path, sync_files=True))

    def load(self):
        import torch.distributed.checkpoint as dcp

        state = self.model.state_dict()
        dcp.load(state, storage_reader=dcp.FileSystemReader(self.path))
        self.model.load_state_dict(state)

    def nbytes(self):
        return _dir_bytes(self.path)


class TorchSave:
    def __init__(self, name, workdir):
        self.model = _model(name)
        self.path = os.path.join(workdir, f"{name}.pt")

    def save(self):
        if dist.get_rank() == 0:
            _save_fsync(self.model.state_dict(), self.path)

    def load(self):
        if dist.get_rank() == 0:
            self.model.load_state_dict(torch.load(self.path, map_location="cpu", weights_only=True))

    def nbytes(self):
        return os.path.getsize(self.path)


METHODS = {"ours tp2": Ours, "DCP tp2": DCP, "torch.save": TorchSave}


def bench_rank(name, workdir, repeats):
    """Worker: every method on this model; ``{method: ([save s], [load s], bytes)}`` per repeat, this rank's."""
    methods = {m: cls(name, workdir) for m, cls in METHODS.items()}
    times = {m: ([], []) for m in methods}
    order = list(methods)
    for r in range(repeats):
        for m in order[r % len(order):] + order[: r % len(order)]:
            _, s = _timed(methods[m].save)
            _, ld = _timed(methods[m].load)
            times[m][0].append(s)
            times[m][1].append(ld)
    dist.barrier()
    me = dist.get_rank()
    return {m: (times[m][0], times[m][1], methods[m].nbytes() if me == 0 else 0) for m in methods}


def _slowest(per_rank, method, k):
    """Median over repeats of the slowest rank's seconds (``k``: 0 save, 1 load)."""
    return statistics.median(max(rank[method][k][r] for rank in per_rank) for r in range(len(per_rank[0][method][k])))


def main(argv=None) -> int:
    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-100m", action="store_true", help="gpt2-tiny only")
    args = ap.parse_args(argv)
    names = ["gpt2-tiny"] if args.skip_100m else list(MODELS)
    pool = get_pool(2, timeout=600.0)
    workdir = tempfile.mkdtemp(prefix="bench_ckpt_")
    print(f"{'model':10s} {'params':>8s} {'method':12s} {'save s':>8s} {'load s':>8s} {'MB':>9s}  "
          f"(median of {args.repeats} repeats, slowest rank)")
    last = None
    try:
        for name in names:
            params = sum(p.numel() for p in _model(name).parameters())
            per_rank = pool.run(bench_rank, name, workdir, args.repeats)
            res = {m: (_slowest(per_rank, m, 0), _slowest(per_rank, m, 1), per_rank[0][m][2]) for m in METHODS}
            for method, (s, ld, nbytes) in res.items():
                print(f"{name:10s} {params / 1e6:7.1f}M {method:12s} {s:8.3f} {ld:8.3f} {nbytes / 1e6:9.2f}")
            ours, peer, single = res["ours tp2"], res["DCP tp2"], res["torch.save"]
            print(f"{name:10s} ours tp2 vs DCP tp2: save {peer[0] / ours[0]:.2f}x, load {peer[1] / ours[1]:.2f}x, "
                  f"bytes {ours[2] / peer[2]:.3f}x; vs torch.save on one rank: save {single[0] / ours[0]:.2f}x, "
                  f"load {single[1] / ours[1]:.2f}x")
            last = (name, peer[0] / ours[0], peer[1] / ours[1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"save {last[1]:.2f}x, load {last[2]:.2f}x vs DCP (tp2, {last[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
