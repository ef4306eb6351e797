"""Dispatch overhead of global tensors vs DTensor, and a 2-way tensor-parallel GPT-2 step.

    python scripts/bench_dispatch.py [--reps 200] [--inner 5] [--steps 15]

Runs on pools of local gloo ranks (CPU, one thread per rank).

**Per-op overhead.** A chain of common ops on small tensors (activations
``x`` 16x64, a 64x64 weight, a bias and LayerNorm affine of 64), each op timed
on its own, in two layouts: ``S0`` (``x`` split along rows, every other
input broadcast) and ``B`` (every input broadcast). Neither layout needs any
communication for these ops, so the time beyond plain torch is the cost of
dispatching. Ops run under ``torch.no_grad()`` (no autograd recording);
``linear`` is two aten ops (``t``, ``addmm``), ``matmul`` is ``mm``. On each
of 1 and 2 ranks, three implementations run the op:

- ``torch``: plain torch on the rank's local tensors (the same local shapes);
- ``ours``: ``sbp_core`` GlobalTensors (``sc.distribute``) in that layout;
- ``DTensor``: ``DTensor.from_local`` of the same locals on
  ``init_device_mesh("cpu", (n,))`` with ``Shard(0)``/``Replicate()``.

Before timing, each implementation's output shard is checked against plain
torch's. Then, after ``--warmup`` untimed calls of each (our decision cache is
hot), ``--reps`` blocks of ``--inner`` back-to-back calls are timed with
``time.perf_counter``; the implementations take turns block by block (the
order rotates), so a noisy machine slows them alike; blocks are short so
that the median skips the ones a preempted rank stretched. A rank's time per op is
the **median** over blocks; the reported time is the **max over ranks**.
Overhead = (time per op) - (plain torch time per op), in microseconds. The
table's ``ratio`` is ours/DTensor overhead. The summary ``dispatch overhead
vs DTensor`` is (sum of our overheads) / (sum of DTensor overheads) over all
ops, both layouts and both rank counts.

**TP step.** The tiny GPT-2 of ``scripts/verify_parity.py`` (``GPT_CFG``,
fp32, dropout 0), batch ``--batch`` x seq ``--seq`` tokens, forward +
backward + AdamW step + zero_grad, on 2 ranks:

- ``ours``: ``recipes.gpt2.model.GPT2LMHeadModel`` with
  ``sc.distribute_module(model, p, {**GPT_TP, **GPT_TP_PINS})`` (Megatron:
  column-parallel ``c_attn``/``c_fc``, row-parallel ``c_proj``s,
  vocab-parallel tied ``wte``/``lm_head`` with vocab-parallel cross-entropy);
  input ids ``B``.
- ``DTensor``: the same GPT-2 written here with ``nn.Linear`` (weights are
  the transposes of our ``Conv1D`` weights, copied from the same initial
  model, so both compute the same function), parallelised with
  ``parallelize_module``: ``ColwiseParallel`` on ``c_attn`` and ``c_fc``,
  ``RowwiseParallel`` on both ``c_proj``s, ``RowwiseParallel`` on ``wte``
  (vocab-parallel embedding), ``ColwiseParallel(output_layouts=Shard(-1))`` on
  ``lm_head`` with ``loss_parallel``; ``lm_head.weight`` is re-tied to the
  sharded ``wte.weight`` after parallelising (both ``Shard(0)``). As in
  torchtitan, the c_attn output is used as a local tensor
  (``use_local_output=True``) whose columns are grouped per head, exactly our
  model's order, so each rank views its own heads. Parameters outside the
  parallel modules (LayerNorms, ``wpe``) stay plain tensors in DTensor's
  idiom, while ours are ``B`` global tensors (every op on them dispatches).

Both steps take turns (barrier before each); each rank takes the median
over ``--steps`` steps after ``--tp-warmup`` untimed ones; the reported
time is the max over ranks. The warmup steps' losses of both are printed
(they agree to ~1e-7: the same math), and one extra untimed step of each
counts its collectives.

Last line: ``dispatch overhead vs DTensor: X.XXx; tp2 step vs DTensor:
Y.YYx`` (ours / DTensor; lower is better).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS, HID = 16, 64
IMPLS = ("torch", "ours", "dtensor")


# -- the op chain ------------------------------------------------------------
# Each op takes (x, w, b, g, beta): activations [16, 64], weight [64, 64],
# bias [64], LayerNorm weight and bias [64].
OPS = {
    "add": lambda x, w, b, g, beta: x + x,
    "mul": lambda x, w, b, g, beta: x * x,
    "relu": lambda x, w, b, g, beta: torch.relu(x),
    "gelu": lambda x, w, b, g, beta: F.gelu(x, approximate="tanh"),
    "sum(dim=-1)": lambda x, w, b, g, beta: x.sum(-1),
    "view": lambda x, w, b, g, beta: x.view(-1, 4, HID // 4),
    "reshape(-1)": lambda x, w, b, g, beta: x.reshape(-1),
    "transpose": lambda x, w, b, g, beta: x.transpose(0, 1),
    "matmul": lambda x, w, b, g, beta: x @ w,
    "linear": lambda x, w, b, g, beta: F.linear(x, w, b),
    "layer_norm": lambda x, w, b, g, beta: F.layer_norm(x, (HID,), g, beta),
    "softmax": lambda x, w, b, g, beta: x.softmax(-1),
}
LAYOUTS = ("S0", "B")


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, HID, generator=gen), torch.randn(HID, HID, generator=gen),
            torch.randn(HID, generator=gen), torch.randn(HID, generator=gen), torch.randn(HID, generator=gen))


def _shard(t, n, me):
    return torch.tensor_split(t, n, 0)[me].contiguous()


def _local_of(out):
    from sbp_core import GlobalTensor
    from torch.distributed.tensor import DTensor

    if isinstance(out, GlobalTensor):
        return out._local
    if isinstance(out, DTensor):
        return out._local_tensor
    return out


def op_worker(reps: int, inner: int, warmup: int) -> list:
    """On every rank: ``[(op, layout, {impl: median us per call})]``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import sbp_core as sc
    from sbp_core import sbp

    n, me = dist.get_world_size(), dist.get_rank()
    p = sc.placement("cpu", list(range(n)))
    mesh = init_device_mesh("cpu", (n,))
    full = _inputs()
    rows = []
    with torch.no_grad():
        for layout in LAYOUTS:
            split = layout == "S0"
            locals_ = [(_shard(t, n, me) if split and i == 0 else t.clone()) for i, t in enumerate(full)]
            ours = [sc.distribute(t, p, sbp.split(0) if split and i == 0 else sbp.broadcast) for i, t in enumerate(full)]
            dts = [DTensor.from_local(loc, mesh, [Shard(0) if split and i == 0 else Replicate()], run_check=False)
                   for i, loc in enumerate(locals_)]
            args = {"torch": locals_, "ours": ours, "dtensor": dts}
            for name, fn in OPS.items():
                want = fn(*locals_)
                for impl in ("ours", "dtensor"):
                    got = _local_of(fn(*args[impl]))
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                        raise AssertionError(f"{name} {layout} on {n} ranks: {impl}'s shard differs from plain torch")
                for impl in IMPLS:
                    a = args[impl]
                    for _ in range(warmup):
                        fn(*a)
                times = {impl: [] for impl in IMPLS}
                for r in range(reps):
                    for k in range(len(IMPLS)):
                        impl = IMPLS[(r + k) % len(IMPLS)]
                        a = args[impl]
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn(*a)
                        times[impl].append((time.perf_counter() - t0) / inner * 1e6)
                rows.append((name, layout, {impl: statistics.median(v) for impl, v in times.items()}))
    return rows


# -- GPT-2 for DTensor: same shapes and math as recipes/gpt2/model.py, with nn.Linear --


class DTAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hs = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # output rows grouped per head: [q_h, k_h, v_h]
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, _ = x.shape
        # Local columns after ColwiseParallel: this rank's whole heads.
        qkv = self.c_attn(x).view(b, t, -1, 3 * self.hs)
        q, k, v = (z.transpose(1, 2) for z in qkv.split(self.hs, dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class DTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class DTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = DTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = DTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class DTGPT2(nn.Module):
    """``forward(ids) -> logits`` (a ``Shard(-1)`` DTensor once parallelised)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(DTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def load_from(self, ref):
        """Copy ``recipes.gpt2`` weights (``Conv1D`` ``[in, out]`` -> ``nn.Linear`` ``[out, in]``)."""
        own = dict(self.named_parameters())
        for name, q in ref.named_parameters():
            name = name.removeprefix("transformer.")
            src = q.t() if q.dim() == 2 and (".c_attn." in name or ".c_proj." in name or ".c_fc." in name) else q
            own[name].copy_(src)


def _dtensor_tp(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.h)):
        plan[f"h.{i}.attn.c_attn"] = ColwiseParallel()
        plan[f"h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"h.{i}.mlp.c_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # both Shard(0) on the vocab rows: keep them one parameter
    return model


def tp_worker(batch: int, seq: int, steps: int, warmup: int) -> dict:
    """On every rank: step times (s) of ours and DTensor, and both runs' losses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    import sbp_core as sc
    from recipes.gpt2.model import GPT2LMHeadModel
    from sbp_core import sbp
    from scripts.verify_parity import GPT_CFG, GPT_TP, GPT_TP_PINS

    cfg = GPT_CFG
    assert seq <= cfg.n_positions, f"seq {seq} exceeds n_positions {cfg.n_positions}"
    n = dist.get_world_size()
    adamw = dict(lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(cfg)
    dtm = DTGPT2(cfg)
    dtm.load_from(ours)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    p = sc.placement("cpu", list(range(n)))
    sc.distribute_module(ours, p, {**GPT_TP, **GPT_TP_PINS})
    ours_opt = torch.optim.AdamW(ours.parameters(), **adamw)
    gids = sc.distribute(ids, p, sbp.broadcast)

    mesh = init_device_mesh("cpu", (n,))
    _dtensor_tp(dtm, mesh)
    dt_opt = torch.optim.AdamW(dtm.parameters(), **adamw)
    x_ids, y_ids = ids, ids[:, 1:].reshape(-1)

    def ours_step():
        loss = ours(gids, gids)[1]
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return loss

    def dt_step():
        logits = dtm(x_ids)
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y_ids)
            loss.backward()
        dt_opt.step()
        dt_opt.zero_grad()
        return loss

    losses = {"ours": [], "dtensor": []}
    times = {"ours": [], "dtensor": []}
    for i in range(warmup + steps):
        order = (("ours", ours_step), ("dtensor", dt_step))
        for name, step in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
            else:  # outside the timed region: the loss on every rank
                losses[name].append(loss.full_tensor().item())
    # One more step each, untimed, counting collectives (ours: the comm ledger; DTensor: CommDebugMode).
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode

    with sc.comm_ledger() as ledger:
        ours_step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn about inputs without grad
        with CommDebugMode() as comm:
            dt_step()
    return {"times": times, "losses": losses, "params": sum(q.numel() for q in dtm.parameters()),
            "collectives": {"ours": ledger.count(), "dtensor": comm.get_total_counts()}}


# -- reporting -------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="timed blocks per op and implementation")
    ap.add_argument("--inner", type=int, default=5, help="calls per timed block")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls per op and implementation")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15, help="timed TP steps per implementation")
    ap.add_argument("--tp-warmup", type=int, default=3, help="untimed TP steps per implementation")
    args = ap.parse_args(argv)

    from toolkit.rank_pool import get_pool

    started = time.perf_counter()
    print(f"per-op dispatch overhead (x {ROWS}x{HID} fp32; S0: x split on rows, weights B; B: all B), "
          f"median of {args.reps} blocks x {args.inner} calls, max over ranks")
    print(f"{'op':14s} {'layout':6s} {'ranks':>5s} {'torch us':>9s} {'ours ovh us':>12s} {'DTensor ovh us':>15s} {'ratio':>7s}")
    ours_total = dt_total = 0.0
    tp_rank = None
    for n in (1, 2):
        pool = get_pool(n, timeout=300.0)
        try:
            per_rank = pool.run(op_worker, args.reps, args.inner, args.warmup)
            if n == 2:  # reuse the 2-rank pool for the TP step
                tp_rank = pool.run(tp_worker, args.batch, args.seq, args.steps, args.tp_warmup)
        finally:
            pool.close()
        sub_ours = sub_dt = 0.0
        for i, (name, layout, _) in enumerate(per_rank[0]):
            t = {impl: max(r[i][2][impl] for r in per_rank) for impl in IMPLS}
            ours_ovh, dt_ovh = t["ours"] - t["torch"], t["dtensor"] - t["torch"]
            sub_ours += ours_ovh
            sub_dt += dt_ovh
            ratio = f"{ours_ovh / dt_ovh:6.2f}x" if dt_ovh > 0 else "    n/a"
            print(f"{name:14s} {layout:6s} {n:5d} {t['torch']:9.1f} {ours_ovh:12.1f} {dt_ovh:15.1f} {ratio:>7s}")
        print(f"{'sum':14s} {'':6s} {n:5d} {'':9s} {sub_ours:12.1f} {sub_dt:15.1f} {sub_ours / sub_dt:6.2f}x")
        ours_total += sub_ours
        dt_total += sub_dt
    dispatch_ratio = ours_total / dt_total
    print(f"{'sum':14s} {'':6s} {'1+2':>5s} {'':9s} {ours_total:12.1f} {dt_total:15.1f} {dispatch_ratio:6.2f}x")
    print("(DTensor dispatches through a C++ fast path with a C++ sharding cache; ours is Python __torch_dispatch__)")

    per_rank = tp_rank
    med = {impl: max(statistics.median(r["times"][impl]) for r in per_rank) * 1e3 for impl in ("ours", "dtensor")}
    lo, ld = per_rank[0]["losses"]["ours"], per_rank[0]["losses"]["dtensor"]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(lo, ld))
    step_ratio = med["ours"] / med["dtensor"]
    print()
    print(f"GPT-2 tp2 step: {per_rank[0]['params']} params, batch {args.batch} x seq {args.seq}, fp32, "
          f"fwd+bwd+AdamW, median of {args.steps} steps after {args.tp_warmup}, max over 2 ranks")
    print("  ours: Megatron plan GPT_TP + GPT_TP_PINS; LayerNorm/wpe params are B global tensors")
    print("  DTensor: parallelize_module Colwise(c_attn, c_fc, lm_head)/Rowwise(c_proj, wte) + loss_parallel; "
          "LayerNorm/wpe params plain tensors")
    print(f"  warmup losses ours    {', '.join(f'{v:.6f}' for v in lo)}")
    print(f"  warmup losses DTensor {', '.join(f'{v:.6f}' for v in ld)}  (max rel diff {loss_diff:.1e})")
    coll = per_rank[0]["collectives"]
    print(f"  collectives per step (rank 0): ours {coll['ours']}, DTensor {coll['dtensor']}")
    print(f"  {'ours ms':>9s} {'DTensor ms':>11s} {'ratio':>7s}")
    print(f"  {med['ours']:9.2f} {med['dtensor']:11.2f} {step_ratio:6.2f}x")
    print(f"(total {time.perf_counter() - started:.0f} s)")
    print(f"dispatch overhead vs DTensor: {dispatch_ratio:.2f}x; tp2 step vs DTensor: {step_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
