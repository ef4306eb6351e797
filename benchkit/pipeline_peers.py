"""Our pipeline and torch.distributed.pipelining's on the same GPT-2 split, as scripts/bench_pipeline.py and
scripts/bench_one_device.py run them: the model split, each side's step, activation and memory
accounting, the per-rank worker, and the benchmark's options (parse)."""
from __future__ import annotations

import argparse
import functools
import gc
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from recipes.gpt2.plan import PIPELINE
from benchkit.heap import HeapPeak, heap_bytes
from benchkit.paired import balanced_orders
from toolkit.stages import keep_stage, stage_ranges

VARIANTS = ("ours 1f1b", "torch 1F1B", "ours gpipe", "torch GPipe")
PAIRS = ((VARIANTS[0], VARIANTS[1]), (VARIANTS[2], VARIANTS[3]))  # (ours, the peer) compared
# --schedules: interleaved (--virtual stages per rank) and zero-bubble schedules against torch's on the same split,
# and our 1F1B beside them (its bubble and trace, unpaired).
SCHEDULE_VARIANTS = ("ours interleaved", "torch Interleaved1F1B", "ours zb", "torch InterleavedZeroBubble",
                     "ours zb2", "torch InterleavedZeroBubble2", "ours zbv", "torch ZBVZeroBubble", "ours 1f1b")
SCHEDULE_PAIRS = tuple((SCHEDULE_VARIANTS[i], SCHEDULE_VARIANTS[i + 1]) for i in (0, 2, 4, 6))
SCHEDULE_TRACE = ("ours 1f1b", "ours interleaved", "ours zbv")  # --trace in --schedules mode: side by side
# Each variant's schedule: (our pp_schedule, stages per rank; None: ``--virtual``, 2 by default); a peer's torch
# class shares its pair's split. A peer's name is its torch class's less ``Schedule``, with a trailing 2 where it
# runs ``--virtual`` stages per rank (zb2 likewise).
SCHEDULES = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "interleaved": ("1f1b", None), "zb": ("zb", 1),
             "zb2": ("zb", None), "zbv": ("zbv", 2), "1F1B": ("1f1b", 1), "GPipe": ("gpipe", 1),
             "Interleaved1F1B": ("1f1b", None), "InterleavedZeroBubble": ("zb", 1),
             "InterleavedZeroBubble2": ("zb", None), "ZBVZeroBubble": ("zbv", 2)}


def schedule_of(variant: str, o) -> tuple:
    """``(our pp_schedule, stages per rank)`` of a variant (``interleaved``, ``Interleaved1F1B``, ...) under the
    options ``o``: the interleaved pairs run ``o.virtual`` stages per rank."""
    schedule, virtual = SCHEDULES[variant]
    return schedule, o.virtual if virtual is None else virtual


ADAMW = dict(lr=1e-3, weight_decay=0.1)
MB = 1 << 20


# -- measurement ---------------------------------------------------------------------------

HEAP = heap_bytes


class SavedActivations:
    """Peak bytes of distinct non-parameter storages autograd holds for backward, while ``on``."""

    def __init__(self, params):
        self.skip = {_storage(p)[0] for p in params}
        self.live, self.peak, self.on = {}, 0, False
        self._bytes, self._lock = 0, threading.Lock()

    def reset(self):
        self.peak, self.on = self._bytes, True

    def _pack(self, t):
        key, nbytes = _storage(t)
        if key in self.skip or not nbytes:
            return t
        with self._lock:
            n, _ = self.live.get(key, (0, nbytes))
            self.live[key] = (n + 1, nbytes)
            if n == 0:
                self._bytes += nbytes
                self.peak = max(self.peak, self._bytes)
        return _Held(t, key, self)

    def _drop(self, key):
        with self._lock:
            n, nbytes = self.live[key]
            if n == 1:
                del self.live[key]
                self._bytes -= nbytes
            else:
                self.live[key] = (n - 1, nbytes)

    def wrap(self, fn):
        """``fn`` run under the counting hooks (on whatever thread calls it) while ``on``."""
        @functools.wraps(fn)
        def counted(*a, **k):
            if not self.on:
                return fn(*a, **k)
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                return fn(*a, **k)

        return counted


class _Held:
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner._drop(self.key)


def _unpack(x):
    return x.t if isinstance(x, _Held) else x


def _storage(t):
    local = getattr(t, "_local", t)  # a GlobalTensor's local shard
    s = local.untyped_storage()
    return s.data_ptr(), s.nbytes()


# -- the two implementations ---------------------------------------------------------------

def _batch(step: int, vocab: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def next_token_loss(logits, labels):
    """``GPT2LMHeadModel``'s loss: cross-entropy of position ``t``'s logits against token ``t + 1``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class StageOutput(nn.Module):
    """A stage of ``GPT2LMHeadModel`` returning one tensor (hidden states, or logits on the last stage)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


class Ours:
    def __init__(self, o, variant: str):
        from benchkit.pipeline_parity import build

        schedule, virtual = schedule_of(variant, o)
        batch_of = functools.partial(_batch, vocab=o.vocab, batch=o.batch, seq=o.seq)
        self.step_, module = build(1, 1, o.pp, o.micro, schedule, True, _cfg(o), batch_of, o.seq, o.batch,
                                   virtual=virtual)
        self.params = list(module.parameters())
        self.acts = SavedActivations(self.params)
        for chunk in self.step_.chunks.values():  # each stage's forward (views of the module, or it)
            chunk.forward = self.acts.wrap(chunk.forward)

    def step(self, i):
        loss = self.step_.step(i)
        return None if loss is None else float(loss)

    def events(self):
        return self.step_.last_trace.wall_events()

    def threads(self) -> dict:
        """``{actor: the name of the thread that ran it}`` in the last step (the executor's own placement)."""
        t = self.step_.last_trace
        return {name: t.threads[tid] for name, tid, *_ in t.events}


class Theirs:
    """``torch.distributed.pipelining``'s schedule ``variant`` (its class name less ``Schedule``) on the same
    split as ours: ``PipelineStage`` per stage this rank holds, placed as our schedule of the pair places it
    (round robin; a V for ZB-V, which torch's class places so itself)."""

    def __init__(self, o, variant: str, tied_groups: dict):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        from runtime.pipeline.schedule import chunk_ranks

        self.o = o
        self.rank = dist.get_rank()
        self.stage = self.rank
        schedule, virtual = schedule_of(variant, o)
        n = o.pp * virtual
        where = chunk_ranks(schedule, o.pp, virtual)
        self.mine = [c for c in range(n) if where[c] == self.rank]
        self.first, self.last = 0 in self.mine, n - 1 in self.mine
        self.tied_group = tied_groups.get((where[0], where[-1]))
        ranges = stage_ranges(o.layers, n)
        models, self.modules = {}, []
        for c in self.mine:
            torch.manual_seed(0)
            models[c] = keep_stage(GPT2LMHeadModel(_cfg(o)), PIPELINE, ranges, c)
            self.modules.append(StageOutput(models[c]))
        # The tied copies held here: the first stage's embedding, the last stage's LM head.
        self.tied = ([models[0].transformer.wte.weight] if self.first else []) + \
            ([models[n - 1].lm_head.weight] if self.last else [])
        self.params = [p for m in self.modules for p in m.parameters()]
        self.opt = torch.optim.AdamW(self.params, **ADAMW)
        self.acts = SavedActivations(self.params)
        for m in self.modules:
            m.forward = self.acts.wrap(m.forward)
        self.pstages = [PipelineStage(m, c, n, torch.device("cpu")) for m, c in zip(self.modules, self.mine)]
        for ps in self.pstages:
            _no_self_p2p(ps)
        self._events = []
        for ps, c in zip(self.pstages, self.mine):
            self._time(ps, c, "forward_one_chunk", "F")
            self._time(ps, c, "backward_one_chunk", "B")
            self._time(ps, c, "backward_weight_one_chunk", "W")
        cls = getattr(pipelining, f"Schedule{variant.removesuffix('2')}")
        # The loss is timed as part of the forward it follows (ours computes it inside the forward).
        loss = self._timed_loss(self.acts.wrap(next_token_loss))
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # takes a list of the rank's stages
        self.schedule = cls(self.pstages if multi else self.pstages[0], o.micro, loss_fn=loss)

    def _time(self, obj, stage, method, kind):
        fn = getattr(obj, method)
        name = f"s{stage}.{kind}@{self.rank}"

        def timed(chunk, *a, **k):
            t = time.time()
            out = fn(chunk, *a, **k)
            self._events.append((name, t, time.time(), chunk))
            return out

        setattr(obj, method, timed)

    def _timed_loss(self, fn):
        def loss(*a):
            out = fn(*a)
            if self._events and ".F@" in self._events[-1][0]:  # not during the schedule's shape inference
                name, t, _, chunk = self._events[-1]
                self._events[-1] = (name, t, time.time(), chunk)
            return out

        return loss

    def step(self, i):
        o, s = self.o, self.stage
        self._events = []
        ids, losses = _batch(i, o.vocab, o.batch, o.seq), []
        args = (ids,) if self.first else ()
        kwargs = dict(target=ids, losses=losses) if self.last else {}
        self.schedule.step(*args, **kwargs, return_outputs=False)
        t = time.time()
        if len(self.tied) == 2:  # both copies here (ZB-V): their sum, locally
            total = self.tied[0].grad + self.tied[1].grad
            for p in self.tied:
                p.grad.copy_(total)
        elif self.tied and self.tied_group is not None:
            dist.all_reduce(self.tied[0].grad, group=self.tied_group)
        t1 = time.time()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._events += [(f"s{s}.reduce@{self.rank}", t, t1, 0), (f"s{s}.update@{self.rank}", t1, time.time(), 0)]
        return float(torch.stack(losses).detach().mean()) if self.last else None

    def events(self):
        return list(self._events)

    def threads(self) -> dict:
        return {}  # every timed action runs on the rank's main thread: the trace's compute track


def _no_self_p2p(stage) -> None:
    """Keep ``stage``'s p2p warm-up off its own rank.

    In torch 2.11, the multi-stage schedules start their first step by sending a dummy tensor to, and
    receiving one from, each stage's neighbours (``_get_init_p2p_neighbors_ops``), a neighbour on the same
    rank included: ZB-V's middle stages (1 and 2 on rank 1). Gloo has no connection to its own rank
    ("Pair is not connected"), so that rank fails and its peer times out on the receive. Each such send
    pairs with a receive of the same rank, on dummy tensors, so dropping both leaves the warm-up (and the
    schedule) as it was between ranks. 2.13's warm-up (a vote) skips same-rank neighbours itself.
    """
    ops_of = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if ops_of is None:
        return
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops_of() if op.group_peer != stage.group_rank]


def _cfg(o) -> GPT2Config:
    return GPT2Config(vocab_size=o.vocab, n_positions=o.seq, n_embd=o.embd, n_layer=o.layers, n_head=o.heads,
                      embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)


# -- the worker ----------------------------------------------------------------------------

def _memory_step(v, i):
    """One step sampled: ``(heap growth peak, saved activations peak, loss, peak's wall time, events)``.

    MKL keeps GEMM packing buffers per OS thread (~12 MB here), allocated at
    a thread's first matmul and freed at its exit. Both sides keep their
    threads from warm-up on (our executor's queue workers are long-lived,
    ``runtime.workers``; the peer runs on the rank's main thread), so those
    buffers are outside the window on both sides.
    """
    gc.collect()
    dist.barrier()
    pre, sampler = HEAP(), HeapPeak()
    v.acts.reset()
    sampler.start()
    loss = v.step(i)
    peak = sampler.stop()
    v.acts.on = False
    return peak - pre, v.acts.peak, loss, sampler.when, v.events()


def worker(o):
    """Every rank: build each variant, warm it up, measure its memory; then timed steps round-robin."""
    rank = dist.get_rank()
    names = variants_of(o)
    # The peer sums tied gradients over the first and last stages' ranks (a group built by every rank).
    tied_groups = {(0, o.pp - 1): dist.new_group([0, o.pp - 1])} if o.pp > 1 else {}
    variants, out = {}, {"stage": rank, "mem": {}, "times": {n: [] for n in names}, "cpu": {n: [] for n in names},
                         "losses": {n: {} for n in names}, "events": {n: [] for n in names}}
    for name in names:
        side, variant = name.split()
        v = Ours(o, variant) if side == "ours" else Theirs(o, variant, tied_groups)
        for i in range(o.warmup):
            out["losses"][name][i] = v.step(i)
        step_peak, saved, loss, when, events = _memory_step(v, o.warmup)
        out["losses"][name][o.warmup] = loss
        out["mem"][name] = dict(step=step_peak, saved=saved, when=when, events=events)
        variants[name] = v
    first = o.warmup + 1
    orders = balanced_orders(list(names))
    for k in range(o.steps):
        for name in orders[k % len(orders)]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            out["losses"][name][first + k] = variants[name].step(first + k)
            out["times"][name].append(time.perf_counter() - t)
            out["cpu"][name].append(time.process_time() - c)
            out["events"][name].append(variants[name].events())
    out["threads"] = {name: v.threads() for name, v in variants.items()}
    return out


# -- reporting -----------------------------------------------------------------------------


def parse(argv=None, description: str = "pipeline benchmark on a GPT-2 split"):
    """The benchmark's options (``scripts/bench_pipeline.py`` and ``scripts/bench_one_device.py`` share them)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--pp", type=int, default=2, choices=(2, 4))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--trace", default=None, help="write the first pair's last step as a Chrome trace here")
    ap.add_argument("--schedules", action="store_true",
                    help="interleaved 1F1B and zb2 (--virtual stages per rank), zb and zbv against torch's "
                         "schedules, not 1f1b and gpipe")
    ap.add_argument("--virtual", type=int, default=2, choices=(2, 3, 4),
                    help="with --schedules: stages per rank of the interleaved pairs (interleaved, zb2)")
    o = ap.parse_args(argv)
    if o.virtual != 2 and not o.schedules:
        ap.error(f"--virtual {o.virtual} sets the interleaved pairs of --schedules: add --schedules")
    per_rank = o.virtual if o.schedules else 1
    if o.batch % o.micro or o.layers % (o.pp * per_rank) or (o.schedules and o.layers % (2 * o.pp)):
        ap.error(f"--batch {o.batch} must divide into --micro {o.micro} and --layers {o.layers} into the stages "
                 f"of every variant (--pp {o.pp}"
                 f"{f' x {o.virtual} and x 2 stages per rank' if o.schedules else ''})")
    return o


def variants_of(o) -> tuple:
    """The variants the options compare, in order."""
    return SCHEDULE_VARIANTS if o.schedules else VARIANTS


def pairs_of(o) -> tuple:
    """``(ours, the peer)`` pairs the options compare."""
    return SCHEDULE_PAIRS if o.schedules else PAIRS
