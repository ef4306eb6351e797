"""ZeRO stages 0-3 on a small GPT-2: bytes each rank holds and sends against the ZeRO paper, and two peers.

    python scripts/bench_zero.py [--steps 5] [--warmup 2] [--rounds 4]

On 4 local gloo ranks (pure data parallel, N = 4), AdamW, for each stage in
fp32 and with bf16 compute copies (fp32 masters):

- bytes of parameters, gradients and optimizer states this rank holds after
  backward (before the step), counted from its tensors' storages
  (``toolkit.zero.held_bytes``), next to the ZeRO paper's formulas (mixed
  precision: stage 0 (2+2+K)Ψ, stage 1 4Ψ+KΨ/N, stage 2 2Ψ+(2+K)Ψ/N,
  stage 3 (2+2+K)Ψ/N with K = 12; fp32: 2, 2, K = 4, 4, 8), Ψ the model's
  parameter count. During the optimizer step the masters' fp32 gradient
  shards (4Ψ/N, mixed precision) exist in addition, as in DeepSpeed;
- the ledger's bytes sent per step (all-gather + reduce-scatter, stage 0's
  all-reduce, and the loss's and gradient norm's scalars), next to 2Ψ
  (stages 0-2) and 3Ψ (stage 3) times (N-1)/N in compute-dtype bytes;
- peak RSS (VmHWM, reset before each run; and how far above the run's
  start it went) and the median step time.

Then ``torch.distributed.optim.ZeroRedundancyOptimizer`` under DDP (ZeRO-1)
and FSDP2 ``fully_shard`` per block and root (ZeRO-3) train the same model
in fp32, each back to back with our fp32 stage 1 / stage 3 for ``--rounds``
rounds, the peer first in every other round; each side's figure of a round
is its median step (worst rank), both sides get the same rounds, and none of
the table's runs count: mem = our bytes held / the peer's (worst rank), thr
= the median over rounds of our tokens/s / the peer's in that round, with
its 90% bootstrap interval; the line before the last compares process CPU
per step the same way (gloo's threads included), which other jobs on the
machine move less than wall time. Last line:
``zero bytes vs formula exact: K/K; vs ZeroRedundancyOptimizer mem X.XXx thr Y.YYx; vs FSDP2 mem X.XXx thr Y.YYx``.
``--json PATH`` also writes the rows (ours per stage and dtype, each peer).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import sbp_core as sc
from benchkit.paired import paired_ratio
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from toolkit.zero import apply_zero, formula_bytes, held_bytes, model_elements, traffic_formula
from toolkit.zero.accounting import count_bytes, optimizer_state
from sbp_core.sbp import Split

WORLD = 4
CFG = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                 embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
BATCH, SEQ = 16, 64  # global batch of sequences
ADAMW = dict(lr=1e-3, weight_decay=0.1)


def _status_mb(field: str) -> float:
    try:
        with open("/proc/self/status") as f:
            return int(re.search(field + r":\s+(\d+)", f.read()).group(1)) / 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> float:
    """Free what earlier runs left, reset the peak to the current RSS; return that baseline (MB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass
    return _status_mb("VmRSS")


def _peak_rss(base: float) -> tuple:
    """(peak RSS, peak above the run's baseline), MB."""
    peak = _status_mb("VmHWM")
    return peak, peak - base


def _batches(steps: int):
    torch.manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ)) for _ in range(steps)]


def _timed(step, batches, warmup: int) -> tuple:
    """Median (wall seconds, process CPU seconds) per step after ``warmup`` steps (the median resists
    other load on the machine; CPU time, gloo's threads included, resists it better)."""
    for ids in batches[:warmup]:
        step(ids)
    times, cpus = [], []
    for ids in batches[warmup:]:
        t0, c0 = time.perf_counter(), time.process_time()
        step(ids)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return sorted(times)[len(times) // 2], sorted(cpus)[len(cpus) // 2]


def run_ours(stage: int, bf16: bool, steps: int, warmup: int) -> dict:
    """Worker: our ZeRO ``stage``; this rank's bytes held and sent, step time, peak RSS."""
    base = _reset_peak_rss()
    torch.manual_seed(0)
    p = sc.placement("cpu", list(range(WORLD)))
    model, zero = apply_zero(GPT2LMHeadModel(CFG), p, {}, stage=stage, dp_axis=0,
                             compute_dtype=torch.bfloat16 if bf16 else None)
    opt = zero.optimizer(torch.optim.AdamW, **ADAMW)
    seen = {}

    def step(ids):
        x = sc.distribute(ids, p, (Split(0),))
        with sc.comm_ledger() as ledger:
            loss = model(x, x)[1]
            loss.backward()
            seen["mem"] = held_bytes(zero, opt)
            zero.sync_grads()
            sc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        seen["by_op"] = ledger.by_op()

    step_s, cpu_s = _timed(step, _batches(warmup + steps), warmup)
    return dict(mem=seen["mem"], by_op=seen["by_op"], psi=model_elements(zero), step_s=step_s, cpu_s=cpu_s,
                rss=_peak_rss(base))


def run_zero_redundancy(steps: int, warmup: int) -> dict:
    """Worker: DDP + ``ZeroRedundancyOptimizer`` (AdamW) on the plain model, fp32."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = _reset_peak_rss()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG)
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    me, n = dist.get_rank(), dist.get_world_size()
    seen = {}

    def step(ids):
        x = ids.tensor_split(n)[me]
        loss = ddp(x, x)[1]
        loss.backward()
        params = list(model.parameters())
        seen["mem"] = count_bytes(params, [q.grad for q in params], optimizer_state(opt.optim))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    step_s, cpu_s = _timed(step, _batches(warmup + steps), warmup)
    return dict(mem=seen["mem"], step_s=step_s, cpu_s=cpu_s, rss=_peak_rss(base))


def run_fsdp2(steps: int, warmup: int) -> dict:
    """Worker: FSDP2 ``fully_shard`` on every block and the root, AdamW, fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = _reset_peak_rss()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    me, n = dist.get_rank(), dist.get_world_size()
    seen = {}

    def step(ids):
        x = ids.tensor_split(n)[me]
        loss = model(x, x)[1]
        loss.backward()
        params = list(model.parameters())
        seen["mem"] = count_bytes(params, [q.grad for q in params], optimizer_state(opt))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    step_s, cpu_s = _timed(step, _batches(warmup + steps), warmup)
    return dict(mem=seen["mem"], step_s=step_s, cpu_s=cpu_s, rss=_peak_rss(base))


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.4f}"


def _code_lines(text: str) -> int:
    """Lines that are neither blank, comments nor docstrings."""
    import ast

    doc = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in doc)


def _lines_of_zero() -> str:
    files = ["toolkit/zero/plan.py", "toolkit/zero/apply.py", "sbp_core/cast.py", "sbp_core/boxing/coalesced.py"]
    total = code = 0
    for f in files:
        with open(os.path.join(ROOT, f)) as fh:
            text = fh.read()
        total += len(text.splitlines())
        code += _code_lines(text)
    return f"{total} lines, {code} without docstrings, comments and blanks ({', '.join(files)})"


def _rss(res) -> str:
    peak = max(r["rss"][0] for r in res)
    return f"{peak:6.1f}+{max(r['rss'][1] for r in res):5.1f}"


def _stage_table(pool, args, rows: list) -> tuple:
    """Every ZeRO stage, fp32 and bf16: bytes held and sent against the paper's formulas; ``(exact, total, Ψ)``."""
    tokens = BATCH * SEQ
    print("bytes this rank holds (MiB; worst rank) measured/formula; bytes it sends per step (ledger, MiB); "
          "peak RSS MB (max over ranks) + above the run's start; median step")
    print(f"{'stage':>5} {'dtype':>5} {'params':>17} {'grads':>17} {'optim states':>17} {'exact':>5} "
          f"{'sent':>7} {'formula':>7} {'peak RSS':>12} {'step s':>7} {'tok/s':>6} {'cpu s':>6}")
    exact = total = 0
    for bf16 in (False, True):
        for stage in (0, 1, 2, 3):
            res = pool.run(run_ours, stage, bf16, args.steps, args.warmup)
            psi = res[0]["psi"]
            want = formula_bytes(stage, psi, WORLD, bf16)
            ok = all(r["mem"][k] == want[k] for r in res for k in want)
            exact += ok
            total += 1
            worst = max(res, key=lambda r: r["mem"]["total"])
            sent = max(sum(r["by_op"].get(op, 0) for op in ("all_gather", "reduce_scatter", "all_reduce")) for r in res)
            step_s = max(r["step_s"] for r in res)
            cols = " ".join(f"{_mb(worst['mem'][k])}/{_mb(want[k])}" for k in ("params", "grads", "optimizer_states"))
            print(f"{stage:>5} {'bf16' if bf16 else 'fp32':>5} {cols} {'yes' if ok else 'NO':>5} "
                  f"{_mb(sent)} {_mb(traffic_formula(stage, psi, WORLD, bf16))} {_rss(res)} "
                  f"{step_s:7.3f} {tokens / step_s:6.0f} {max(r['cpu_s'] for r in res):6.3f}")
            rows.append(dict(kind="ours", stage=stage, dtype="bf16" if bf16 else "fp32", held=worst["mem"], formula=want,
                             exact=ok, sent=sent, sent_formula=traffic_formula(stage, psi, WORLD, bf16), step_s=step_s))
    print(f"Ψ = {psi:,} parameters, N = {WORLD}. formula: held per the ZeRO paper (K = 12 mixed, 8 fp32); "
          "sent = 2Ψ(N-1)/N for stages 0-2 and 3Ψ(N-1)/N for stage 3, in compute-dtype bytes "
          "(measured adds the loss's and the gradient norm's scalars)")
    return exact, total, psi


def _against_peers(pool, args, peers: dict, rows: list) -> tuple:
    """Ours and each peer back to back, alternating which goes first, ``args.rounds`` times; per peer
    ``(walls, cpus)`` as ``(ours, peer)`` lists of the worst rank's median step, the held-bytes ratio, and the
    peers that failed."""
    tokens = BATCH * SEQ
    walls: dict = {n: ([], []) for n in peers}
    cpus: dict = {n: ([], []) for n in peers}
    held_ratio, failed = {}, set()
    for rnd in range(args.rounds):
        for name, (fn, stage) in peers.items():
            if name in failed:
                continue
            runs = [("ours", lambda stage=stage: pool.run(run_ours, stage, False, args.steps, args.warmup)),
                    ("peer", lambda fn=fn: pool.run(fn, args.steps, args.warmup))]
            got = {}
            try:
                for side, run in runs if rnd % 2 == 0 else runs[::-1]:
                    got[side] = run()
            except Exception as exc:  # noqa: BLE001  (report the peer's failure, keep the other numbers)
                print(f"{name}: failed: {str(exc).splitlines()[0]}")
                failed.add(name)
                continue
            mine, res = got["ours"], got["peer"]
            walls[name][0].append(max(r["step_s"] for r in mine))
            walls[name][1].append(max(r["step_s"] for r in res))
            cpus[name][0].append(max(r["cpu_s"] for r in mine))
            cpus[name][1].append(max(r["cpu_s"] for r in res))
            worst = max(res, key=lambda r: r["mem"]["total"])
            held_ratio[name] = max(r["mem"]["total"] for r in mine) / worst["mem"]["total"]
            if rnd == args.rounds - 1:
                ours_s, peer_s = statistics.median(walls[name][0]), statistics.median(walls[name][1])
                cols = " ".join(f"{k} {_mb(worst['mem'][k])}" for k in ("params", "grads", "optimizer_states"))
                print(f"{name} (vs our fp32 stage {stage}): {cols} MiB; peak RSS {_rss(res)} MB; median over "
                      f"{args.rounds} rounds of the median step {peer_s:.3f}s ({tokens / peer_s:.0f} tok/s) vs ours "
                      f"{ours_s:.3f}s ({tokens / ours_s:.0f} tok/s)")
                rows.append(dict(kind=name, stage=stage, dtype="fp32", held=worst["mem"], step_s=peer_s,
                                 ours_step_s=ours_s, rounds_ours=walls[name][0], rounds_peer=walls[name][1]))
    return walls, cpus, held_ratio, failed


def main(argv=None) -> int:
    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="head-to-head rounds against each peer")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows = []  # for --json: what each table line and peer line prints
    pool = get_pool(WORLD, timeout=600)
    print(f"GPT-2 n_layer={CFG.n_layer} n_embd={CFG.n_embd} vocab={CFG.vocab_size}, batch {BATCH}x{SEQ}, "
          f"dp N={WORLD} gloo ranks, AdamW; ZeRO as an SBP rewrite: {_lines_of_zero()}")
    exact, total, psi = _stage_table(pool, args, rows)
    peers = {"ZeroRedundancyOptimizer": (run_zero_redundancy, 1), "FSDP2": (run_fsdp2, 3)}
    walls, cpus, held_ratio, failed = _against_peers(pool, args, peers, rows)
    thr = {n: paired_ratio(walls[n][1], walls[n][0]) for n in peers if n not in failed and walls[n][0]}
    tail = "; ".join(f"vs {n} mem {held_ratio[n]:.2f}x thr {thr[n][0]:.2f}x" if n in thr else f"vs {n} failed"
                     for n in peers)
    print("mem = our bytes held / the peer's (worst rank; lower is better); thr = our tokens/s / the peer's, the "
          f"median over {args.rounds} rounds of each round's ratio (ours and the peer back to back, alternating "
          "which goes first; higher is better), 90% intervals: " + "; ".join(
              f"{n} {lo:.2f}-{hi:.2f}" for n, (_, lo, hi) in thr.items()))
    print("by CPU time (median process CPU per step, worst rank, gloo's threads included; the load of other jobs "
          "moves it less than wall time): " + "; ".join(
              f"vs {n} {paired_ratio(cpus[n][1], cpus[n][0])[0]:.2f}x" for n in thr))
    print(f"zero bytes vs formula exact: {exact}/{total}; {tail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setting": {**vars(args), "psi": psi, "world": WORLD, "tokens_per_step": BATCH * SEQ},
                       "rows": rows}, f, indent=1)
    return 0 if exact == total else 1


if __name__ == "__main__":
    sys.exit(main())
