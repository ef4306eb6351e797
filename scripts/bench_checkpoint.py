"""Checkpoint save and load time and bytes, ours vs ``torch.save`` of the full state dict on one rank.

    python scripts/bench_checkpoint.py [--repeats 3] [--skip-100m]

Models: gpt2-tiny (``configs/model/gpt2-tiny.yaml``: 4 layers, 128 wide,
8192 tokens, 1.6M parameters) and a ~100M GPT-2 (GPT-2 small's 12 layers of
768 with a 16384-token vocabulary, 98M parameters), fp32 weights.

- ``torch.save``: rank 0 saves the full ``state_dict`` to one file and loads
  it back (``torch.load(weights_only=True)``), the usual single-rank way;
  ``torch.save+fsync`` also flushes the file to disk, as a checkpoint that
  must survive a machine crash has to (ours always does).
- ``ours single``: ``toolkit.checkpoint.save``/``load`` on one rank: DCP's
  planning, raw chunk bytes with a CRC-32 per record (computed on save,
  checked on load), fsync of every file, JSON metadata and state, manifest,
  rename and ``latest`` (``torch.save`` does none of the durability work).
- ``ours tp2``: the same model tensor-parallel on two ranks (Megatron's
  plan): each rank writes and reads its own half.

Every time is the best of ``--repeats`` runs; a row's seconds are the slowest
rank's. Two ranks share this machine's cores with everything else running,
so absolute times vary; ratios come from the same run. Last line: speed
ratios of ``ours tp2`` on the ~100M model, ``torch.save`` seconds divided by
ours (above 1: ours is faster).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sbp_core as sc  # noqa: E402
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel  # noqa: E402
from scripts.verify_parity import GPT_TP  # noqa: E402
from toolkit import checkpoint as ckpt  # noqa: E402

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


def bench_rank(name, workdir, repeats):
    """Worker: every method on this model; returns ``{method: (save s, load s, bytes)}`` (slowest rank's times)."""
    me = dist.get_rank()
    model = _model(name)
    full = model.state_dict()  # the tied LM head shares the embedding's storage: torch.save writes it once
    results = {}
    # torch.save on rank 0
    path = os.path.join(workdir, f"{name}.pt")
    best_s = best_l = float("inf")
    for _ in range(repeats):
        if me == 0:
            _, s = _timed(lambda: torch.save(full, path))
            _, ld = _timed(lambda: torch.load(path, map_location="cpu", weights_only=True))
        else:
            _, s = _timed(lambda: None)
            _, ld = _timed(lambda: None)
        best_s, best_l = min(best_s, s), min(best_l, ld)
    nbytes = os.path.getsize(path) if me == 0 else 0
    results["torch.save"] = (best_s, best_l, nbytes)
    best_s = float("inf")
    for _ in range(repeats):
        _, s = _timed(lambda: _save_fsync(full, path) if me == 0 else None)
        best_s = min(best_s, s)
    results["torch.save+fsync"] = (best_s, results["torch.save"][1], nbytes)
    for layout, ranks, plan in (("ours single", [0], {}), ("ours tp2", [0, 1], GPT_TP)):
        m = _model(name)
        sc.distribute_module(m, sc.placement("cpu", ranks), plan)
        root = os.path.join(workdir, f"{name}-{layout.replace(' ', '_')}")
        best_s = best_l = float("inf")
        for step in range(repeats):
            state = {"model": m.state_dict()}
            saved, s = _timed(lambda: ckpt.save(root, step, state, keep_last=1))
            template = {"model": m.state_dict()}
            _, ld = _timed(lambda: ckpt.load(saved, template))
            best_s, best_l = min(best_s, s), min(best_l, ld)
        nbytes = _dir_bytes(saved) if me == 0 else 0
        results[layout] = (best_s, best_l, nbytes)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return {k: (max(g[k][0] for g in gathered), max(g[k][1] for g in gathered), gathered[0][k][2])
            for k in results}


def main(argv=None) -> int:
    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-100m", action="store_true", help="gpt2-tiny only")
    args = ap.parse_args(argv)
    names = ["gpt2-tiny"] if args.skip_100m else list(MODELS)
    pool = get_pool(2, timeout=600.0)
    workdir = tempfile.mkdtemp(prefix="bench_ckpt_")
    print(f"{'model':10s} {'params':>8s} {'method':17s} {'save s':>8s} {'load s':>8s} {'MB':>9s}")
    last = None
    try:
        for name in names:
            params = sum(p.numel() for p in _model(name).parameters())
            res = pool.run(bench_rank, name, workdir, args.repeats)[0]
            for method, (s, ld, nbytes) in res.items():
                print(f"{name:10s} {params / 1e6:7.1f}M {method:17s} {s:8.3f} {ld:8.3f} {nbytes / 1e6:9.2f}")
            base, durable, ours = res["torch.save"], res["torch.save+fsync"], res["ours tp2"]
            print(f"{name:10s} ours tp2 vs torch.save: save {base[0] / ours[0]:.2f}x, load {base[1] / ours[1]:.2f}x, "
                  f"bytes {ours[2] / base[2]:.3f}x; save {durable[0] / ours[0]:.2f}x vs torch.save+fsync")
            last = (base[0] / ours[0], base[1] / ours[1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"save {last[0]:.2f}x, load {last[1]:.2f}x vs torch.save")
    return 0


if __name__ == "__main__":
    sys.exit(main())
