"""Our dp2 / tp2 / pp2 GPT-2 training against DDP, DTensor TP and torch.distributed.pipelining; single-process MFU.

    python scripts/bench_gpt.py [--seq 128] [--batch 16] [--micro 4] [--steps 6] [--warmup 2]
                                [--only dp2,tp2,pp2,single]

About 4 minutes on 2 shared CPU cores (the first run also tokenizes the corpus
into ``~/.cache/sbp-recipes``).

One process tree: a 2-rank gloo pool (``toolkit.rank_pool``, CPU, one
intra-op thread per rank) runs three pairs in turn, then a 1-rank pool runs
the single-process pair. Every variant trains ``gpt2-tiny`` (4 layers,
n_embd 128, 4 heads, vocab 8192; ``model.n_positions = --seq``), fp32,
dropout 0, seed 1234, on a global batch of ``--batch`` sequences of
``--seq`` tokens cut into micro-batches of ``--micro`` rows per rank
(accumulation ``batch / (micro * dp)``: 2 for dp2, 4 for tp2, pp2 and
single), AdamW (``toolkit.optim``: lr 6e-4 with warmup + cosine, betas 0.9/0.95,
weight decay on 2-D weights only), no gradient clipping
(``trainer.grad_clip=0``), for ``--warmup`` untimed steps, one untimed memory
step and ``--steps`` timed steps.

- ``ours``: ``toolkit.trainer.Job`` from ``compose(["parallel=<p>", ...])``,
  timing ``job.pipe.step(i)``: the whole step as actors, **including our data
  path** (each micro-batch read from the tokenized stdlib corpus file by the
  runtime's read/decode/collate actors), forward, backward, the gradient
  reduction and the optimizer + LR scheduler step.
- ``DDP``: plain ``GPT2LMHeadModel`` (``recipes.gpt2.model``) in
  ``DistributedDataParallel`` (gloo), ``no_sync`` on all but the last
  micro-batch.
- ``DTensor-TP``: ``benchkit.dtensor_gpt.DTGPT2`` (the same GPT-2 with
  ``nn.Linear``; weights copied, transposed, from ours' initial model) under
  ``parallelize_module``: Colwise ``c_attn``/``c_fc``, Rowwise ``c_proj``,
  vocab-parallel ``wte`` (Rowwise) and ``lm_head`` (Colwise, ``Shard(-1)``)
  with ``loss_parallel`` — the same Megatron plan as ours.
- ``torch-PP``: ``PipelineStage`` per stage (``toolkit.stages.keep_stage`` on
  the plain model, 2 layers each) under ``Schedule1F1B`` with the same
  micro-batch count; the tied ``wte``/``lm_head`` gradient is summed by one
  ``all_reduce`` between the stages, as ours sums it across placements.
- ``torch`` (single): the plain model, eager, same accumulation.

Peers train on exactly our token batches, pre-loaded into memory before any
timing (so their data loading is excluded; ours is not): with the same seed,
initial weights and optimizer, each step's loss must agree with ours (the
``loss`` column shows the first timed step's; ``max rel diff`` is over all
steps), which checks that each pair computes the same thing.

**Time.** The pair's steps alternate (the order flips every step) so that
other load on the machine hits both alike; every rank waits on a barrier,
then times its step; a step's time is the max over ranks, a variant's the
median over its timed steps; tokens/s = batch x seq / that. ``cpu ms`` is
the same statistic of the process CPU time a rank spends in its step (all
its threads): on a machine shared with other jobs wall time is mostly
waiting for a core, CPU time is the work done, so the pair line also gives
the throughput ratio by CPU time (theirs / ours). A rank blocked in a
collective costs wall time but little CPU time.

**Memory** (per rank, max over ranks; the C heap, i.e. glibc ``mallinfo2``
in-use bytes, arena + mmapped chunks of every thread, where torch's CPU
tensors live): ``persist`` = the heap growth from building the variant and
running its warm-up steps, read after them (parameters, AdamW state, DDP
buckets, process groups, runtime registers and caches, ours' tokenizer);
``step`` = the heap's high-water mark above the step's start during one
untimed step, sampled every ~0.2 ms by a thread (activations held for
backward, gradients, logits, communication buffers). ``peak = persist +
step``; the memory ratio is ours / theirs of ``peak``. This is heap in use,
not RSS, so allocator caching and fragmentation do not count; Python objects
in pymalloc arenas do not either (small).

**MFU** (single process): tokens/s x FLOPs/token
(``recipes.gpt2.flops.model_flops_per_token``: 6 N + 12 L H Q T) over
``measured_peak_tflops(repeats=10)`` (the best of ten fp32 1024^3 matmuls on
this process's one thread; best-of is robust to other load, the median step
is not, so on a busy machine this MFU is low; the same MFU per CPU-second,
i.e. with the step's CPU time instead of its wall time, is printed next to
it). The plain-torch MFU is printed for reference.

Prints one table per pair and a summary; last line:
``vs DDP X.XXx, vs DTensor-TP Y.YYx, vs torch-PP Z.ZZx; single-process MFU W%``
(ratios = our tokens/s / theirs; above 1 favours ours). ``--json PATH``
also writes each pair's summary (the numbers its table prints).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import gc
import importlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F


from benchkit.heap import HeapPeak, heap_bytes

MB = 1 << 20
PAIRS = (("dp2", "DDP"), ("tp2", "DTensor-TP"), ("pp2", "torch-PP"), ("single", "torch"))


# -- memory --------------------------------------------------------------------------------

HEAP = heap_bytes


def _settled_heap() -> int:
    gc.collect()
    return HEAP()


def _step_high_water(step) -> tuple:
    """``(step's return value, heap high-water above the start)`` of ``step()``, sampled on a thread."""
    gc.collect()
    start, sampler = HEAP(), HeapPeak()
    sampler.start()
    try:
        out = step()
    finally:
        peak = sampler.stop()
    return out, peak - start


# -- the variants ----------------------------------------------------------------------------

def _config(o, parallel: str, run_dir: str):
    from toolkit.config import compose

    return compose([f"parallel={parallel}", "logger=none", "trainer.eval_every=0", "model.dropout=0.0",
                    "model=gpt2-tiny", f"model.n_positions={o.seq}", f"model.vocab_size={o.vocab}",
                    f"data.max_bytes={o.max_bytes}", f"trainer.global_batch_size={o.batch}",
                    f"trainer.micro_batch_size={o.micro}", "trainer.grad_clip=0", "trainer.log_every=1000",
                    f"trainer.max_steps={o.warmup + 1 + o.steps}", "trainer.warmup_steps=2"], run_dir=run_dir)


class Ours:
    def __init__(self, o, parallel: str, run_dir: str):
        from recipes.gpt2.recipe import RECIPE
        from toolkit.trainer import Job

        self.cfg = _config(o, parallel, run_dir)
        self.job = Job(self.cfg, RECIPE)

    def step(self, i):
        return self.job.pipe.step(i)

    def batches(self, steps: int) -> list:
        """This rank's micro-batches (token ids) of steps ``0 .. steps-1``, read now, for a peer."""
        mb, accum = self.job.train_batches, self.job.layout.accumulation
        return [[mb.load(i, k)["input_ids"] for k in range(accum)] for i in range(steps)]

    def loss(self, value):
        return None if value is None else float(value)  # the global mean on rank 0 and the last stage


def _plain_model(cfg):
    from recipes.gpt2.recipe import RECIPE

    torch.manual_seed(int(cfg.trainer.seed))  # the Job's initialisation
    return RECIPE.build_model(cfg.model)


def _adamw(module, cfg):
    from toolkit.optim import build_optimizer, build_scheduler

    opt = build_optimizer(module, cfg.trainer)
    return opt, build_scheduler(opt, cfg.trainer)


class Eager:
    """Plain torch (optionally ``DistributedDataParallel``) with gradient accumulation."""

    def __init__(self, ours: Ours, n_steps: int, ddp: bool):
        from torch.nn.parallel import DistributedDataParallel

        self.data = ours.batches(n_steps)
        model = _plain_model(ours.cfg)
        self.model = DistributedDataParallel(model) if ddp else model
        self.opt, self.sched = _adamw(model, ours.cfg)

    def step(self, i):
        micro = self.data[i]
        total = 0.0
        for k, x in enumerate(micro):
            last = k == len(micro) - 1
            ctx = self.model.no_sync() if not last and hasattr(self.model, "no_sync") else contextlib.nullcontext()
            with ctx:
                loss = self.model(x, x)[1]
                (loss / len(micro)).backward()
            total += loss.detach()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return total / len(micro)

    def loss(self, value):
        """The global mean (the dp ranks' mean)."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            t = value.clone()
            torch.distributed.all_reduce(t)
            return float(t) / torch.distributed.get_world_size()
        return float(value)


class DTensorTP:
    """``DTGPT2`` of ``benchkit.dtensor_gpt`` under its Megatron ``parallelize_module`` plan."""

    def __init__(self, ours: Ours, n_steps: int):
        from torch.distributed.device_mesh import init_device_mesh

        from benchkit.dtensor_gpt import DTGPT2, _dtensor_tp

        self.data = ours.batches(n_steps)
        ref = _plain_model(ours.cfg)
        self.model = DTGPT2(ref.config)
        self.model.load_from(ref)
        _dtensor_tp(self.model, init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
        self.opt, self.sched = _adamw(self.model, ours.cfg)

    def step(self, i):
        from torch.distributed.tensor.parallel import loss_parallel

        micro = self.data[i]
        total = 0.0
        for x in micro:
            logits = self.model(x)
            with loss_parallel():
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
                (loss / len(micro)).backward()
            total += loss.detach().to_local()  # Replicate: every rank holds the full loss
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return total / len(micro)

    def loss(self, value):
        return float(value)


class _StageOutput(torch.nn.Module):
    """A stage of ``GPT2LMHeadModel`` returning one tensor: hidden states, or logits on the last stage."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def _next_token_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class TorchPP:
    """``PipelineStage`` + ``Schedule1F1B`` over the plain model's stages (one stage per rank)."""

    def __init__(self, ours: Ours, n_steps: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from recipes.gpt2.plan import PIPELINE
        from toolkit.stages import keep_stage, stage_ranges

        cfg, lay = ours.cfg, ours.job.layout
        self.data = [torch.cat(m) for m in ours.batches(n_steps)]  # the schedule chunks it back into micro-batches
        self.stage, self.pp = torch.distributed.get_rank(), lay.pp
        model = keep_stage(_plain_model(cfg), PIPELINE, stage_ranges(int(cfg.model.n_layer), lay.pp), self.stage)
        self.tied = model.transformer.wte.weight if self.stage == 0 else model.lm_head.weight
        self.module = _StageOutput(model)
        self.opt, self.sched = _adamw(self.module, cfg)
        stage = PipelineStage(self.module, self.stage, lay.pp, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, lay.accumulation, loss_fn=_next_token_loss)

    def step(self, i):
        x, losses = self.data[i], []
        if self.stage == 0:
            self.schedule.step(x, return_outputs=False)
        else:
            self.schedule.step(target=x, losses=losses, return_outputs=False)
        torch.distributed.all_reduce(self.tied.grad)  # the tied embedding's two copies: one gradient
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack(losses).detach().mean() if losses else None

    def loss(self, value):
        return None if value is None else float(value)


# -- the worker ------------------------------------------------------------------------------

def _import_all():
    """Import both sides' modules up front, so no variant's memory counts another's first imports."""
    for name in ("torch.distributed.pipelining", "torch.distributed.tensor.parallel", "torch.nn.parallel",
                 "recipes.gpt2.recipe", "benchkit.dtensor_gpt", "toolkit.trainer"):
        importlib.import_module(name)


def pair_worker(o, parallel: str, run_dir: str) -> dict:
    """On every rank: build ours then the peer, warm both up, one memory step each, timed steps alternating."""
    import torch.distributed as dist

    _import_all()
    n_steps = o.warmup + 1 + o.steps
    variants, persist = {}, {}
    for name in ("ours", "theirs"):
        base = _settled_heap()
        if name == "ours":
            v = Ours(o, parallel, run_dir)
        elif parallel == "dp2":
            v = Eager(variants["ours"], n_steps, ddp=True)
        elif parallel == "single":
            v = Eager(variants["ours"], n_steps, ddp=False)
        elif parallel == "tp2":
            v = DTensorTP(variants["ours"], n_steps)
        else:
            v = TorchPP(variants["ours"], n_steps)
        variants[name] = v
        losses = {}
        for i in range(o.warmup):
            losses[i] = v.loss(v.step(i))
        persist[name] = _settled_heap() - base
        v.losses = losses
    out = {"persist": persist, "step_mem": {}, "times": {n: [] for n in variants}, "cpu": {n: [] for n in variants},
           "losses": {}}
    for name, v in variants.items():
        dist.barrier()
        value, high = _step_high_water(lambda: v.step(o.warmup))
        v.losses[o.warmup] = v.loss(value)
        out["step_mem"][name] = high
    for j, i in enumerate(range(o.warmup + 1, n_steps)):
        order = ("ours", "theirs") if j % 2 == 0 else ("theirs", "ours")
        for name in order:
            v = variants[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            value = v.step(i)
            out["times"][name].append(time.perf_counter() - t0)
            out["cpu"][name].append(time.process_time() - c0)
            v.losses[i] = v.loss(value)  # after the clock: a peer's loss may need a collective
    out["losses"] = {n: v.losses for n, v in variants.items()}
    if parallel == "single":
        from recipes.gpt2.flops import model_flops_per_token
        from toolkit.flops import measured_peak_tflops

        cfg = variants["ours"].cfg
        out["peak_tflops"] = measured_peak_tflops(repeats=10)
        out["flops_per_token"] = model_flops_per_token(cfg.model, int(cfg.data.seq_len),
                                                       n_params=variants["ours"].job.n_params)
    return out


# -- reporting -------------------------------------------------------------------------------

def _summarize(o, per_rank: list) -> dict:
    tokens = o.batch * o.seq
    res = {}
    for name in ("ours", "theirs"):
        steps = [max(r["times"][name][j] for r in per_rank) for j in range(o.steps)]
        cpu = [max(r["cpu"][name][j] for r in per_rank) for j in range(o.steps)]
        losses = {}
        for r in per_rank:
            for i, v in r["losses"][name].items():
                if v is not None:
                    losses.setdefault(i, v)
        res[name] = dict(step_s=statistics.median(steps), tok_s=tokens / statistics.median(steps),
                         cpu_s=statistics.median(cpu),
                         persist=max(r["persist"][name] for r in per_rank) / MB,
                         step=max(r["step_mem"][name] for r in per_rank) / MB,
                         peak=max(r["persist"][name] + r["step_mem"][name] for r in per_rank) / MB,
                         losses=losses)
    common = sorted(set(res["ours"]["losses"]) & set(res["theirs"]["losses"]))
    res["loss_diff"] = max((abs(res["ours"]["losses"][i] - res["theirs"]["losses"][i]) / abs(res["theirs"]["losses"][i])
                            for i in common), default=float("nan"))
    res["ratio"] = res["ours"]["tok_s"] / res["theirs"]["tok_s"]
    res["cpu_ratio"] = res["theirs"]["cpu_s"] / res["ours"]["cpu_s"]
    res["mem_ratio"] = res["ours"]["peak"] / res["theirs"]["peak"] if res["theirs"]["peak"] > 0 else float("nan")
    return res


def _table(parallel: str, peer: str, res: dict, first_timed: int) -> list:
    lines = [f"{'variant':18s} {'step ms':>8s} {'tokens/s':>9s} {'cpu ms':>7s} {'persist MiB':>11s} {'step MiB':>9s} "
             f"{'peak MiB':>9s} {'loss':>9s}"]
    for name, label in (("ours", f"ours {parallel}"), ("theirs", peer)):
        r = res[name]
        loss = r["losses"].get(first_timed)
        lines.append(f"{label:18s} {r['step_s'] * 1e3:8.1f} {r['tok_s']:9.0f} {r['cpu_s'] * 1e3:7.0f} {r['persist']:11.1f} "
                     f"{r['step']:9.1f} "
                     f"{r['peak']:9.1f} {loss if loss is not None else float('nan'):9.5f}")
    lines.append(f"ours / {peer}: {res['ratio']:.2f}x tokens/s ({res['cpu_ratio']:.2f}x by CPU time), "
                 f"{res['mem_ratio']:.2f}x peak memory; "
                 f"loss max rel diff {res['loss_diff']:.1e} over {len(res['ours']['losses'])} steps")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (model.n_positions)")
    ap.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (before the memory step)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-bytes", type=int, default=300000, help="stdlib corpus bytes to tokenize")
    ap.add_argument("--only", default="dp2,tp2,pp2,single", help="comma-separated subset of dp2,tp2,pp2,single")
    ap.add_argument("--json", default=None, help="also write each pair's summary to this JSON file")
    o = ap.parse_args(argv)

    from toolkit.rank_pool import get_pool

    started = time.perf_counter()
    wanted = o.only.split(",")
    print(f"gpt2-tiny (4 layers, n_embd 128, 4 heads, vocab {o.vocab}), seq {o.seq}, global batch {o.batch}, "
          f"micro-batch {o.micro} rows/rank, fp32, AdamW, no clipping; {o.warmup} warm-up + 1 memory + "
          f"{o.steps} timed steps, alternating; step = max over ranks, median over steps; "
          f"memory = C heap per rank, max over ranks")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_gpt-") as run_dir:
        for parallel, peer in PAIRS:
            if parallel not in wanted:
                continue
            n = 1 if parallel == "single" else 2
            pool = get_pool(n, timeout=300.0)
            try:
                per_rank = pool.run(pair_worker, o, parallel, run_dir)
            finally:
                pool.close()
            res = results[parallel] = _summarize(o, per_rank)
            print()
            print(f"== {parallel} vs {peer} ({n} rank{'s' if n > 1 else ''})")
            for line in _table(parallel, peer, res, o.warmup + 1):
                print(line)
            if parallel == "single":
                r0 = per_rank[0]
                res["peak"], res["fpt"] = r0["peak_tflops"], r0["flops_per_token"]
                for name, label in (("ours", "ours single"), ("theirs", "torch eager")):
                    tf = res[name]["tok_s"] * res["fpt"] / 1e12
                    res[name]["mfu"] = tf / res["peak"]
                    busy = o.batch * o.seq / res[name]["cpu_s"] * res["fpt"] / 1e12 / res["peak"]
                    print(f"{label}: {tf * 1e3:.2f} GFLOP/s model = {res[name]['mfu'] * 100:.1f}% MFU "
                          f"({busy * 100:.1f}% per CPU-second; {res['fpt'] / 1e6:.2f} MFLOP/token, "
                          f"measured peak {res['peak'] * 1e3:.1f} GFLOP/s on one thread)")
    print(f"(total {time.perf_counter() - started:.0f} s)")

    def ratio(p):
        return f"{results[p]['ratio']:.2f}x" if p in results else "n/a"

    mfu = f"{results['single']['ours']['mfu'] * 100:.1f}%" if "single" in results else "n/a"
    print(f"vs DDP {ratio('dp2')}, vs DTensor-TP {ratio('tp2')}, vs torch-PP {ratio('pp2')}; single-process MFU {mfu}")
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"setting": vars(o), "tokens_per_step": o.batch * o.seq, "peers": dict(PAIRS),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
