"""Our pipelined GPT-2 (schedules from placements and register quotas) against ``torch.distributed.pipelining``.

    python scripts/bench_pipeline.py [--pp 2|4] [--micro 8] [--steps 6] [--warmup 1] [--schedules [--virtual 2]]

On ``pp`` local gloo ranks (one rank pool, CPU, one intra-op thread per rank),
four variants train the same GPT-2 (``--layers 8 --embd 256 --heads 8 --vocab
8192``, fp32, dropout 0, init ``torch.manual_seed(0)``), cut into ``pp``
stages of uniform layers (``toolkit.stages``: embeddings on the first stage,
``ln_f`` and the LM head on the last), global batch ``--batch 16`` x ``--seq
128`` tokens in ``--micro 8`` micro-batches, AdamW(lr 1e-3, wd 0.1). All four
live on the same ranks of one pool for the whole run:

- ``ours 1f1b`` / ``ours gpipe``: ``benchkit.pipeline_parity.build(1, 1, pp,
  ...)``, a ``runtime.pipeline.PipelineStep`` whose order comes from the
  activation stash's quota (``pp - s`` or ``m``) and backward-first priority;
- ``torch 1F1B`` / ``torch GPipe``: ``PipelineStage`` + ``Schedule1F1B`` /
  ``ScheduleGPipe`` over the same stage modules, split by hand with
  ``toolkit.stages.keep_stage`` (no tracing); a wrapper returns the stage's
  hidden states (or logits), and the schedule's ``loss_fn`` is
  ``GPT2LMHeadModel``'s next-token cross-entropy (``scale_grads`` divides by
  ``m`` as we divide each micro-batch's loss by ``m``; ``return_outputs=False``).

``--schedules`` runs eight other variants instead, in four pairs on the
same split into ``v pp``, ``2 pp`` or ``pp`` stages: ``ours interleaved`` (1F1B,
``pp_virtual=2``, stages round robin; ``--virtual 3`` or ``4`` for more
stages per rank, with ``--layers`` a multiple of ``2 pp`` and of ``v pp``:
``--layers 12`` at pp2 and v3, 24 at pp4) against ``ScheduleInterleaved1F1B``;
``ours zb`` (ZB-H1) against ``ScheduleInterleavedZeroBubble`` with one stage
per rank (torch's nearest: its ZB1P, whose warm-up with one stage per rank
is 1F1B's); ``ours zb2`` (interleaved zero bubble, ``pp_virtual=2``, or
``--virtual``) against the same class with as many stages per rank, round
robin; ``ours zbv`` against ``ScheduleZBVZeroBubble`` (two stages per
rank in a V, so the first and last stage, and their tied copies, share
rank 0, where the peer sums them locally); and ``ours 1f1b`` on ``pp``
stages beside them, unpaired (its bubble; with ``--trace``, the trace
shows ``ours 1f1b``, ``ours interleaved`` and ``ours zbv``). Its last line is
``schedules: interleaved A.AAx thr B.BBx mem; zb C.CCx thr D.DDx mem; zb2
G.GGx thr H.HHx mem; zbv E.EEx thr F.FFx mem (vs torch)``.

Tied embedding / LM head, the same on both sides: the first and last stage
copies start equal; after the micro-batches their gradients are summed (ours
by cross-placement boxing, ``runtime.pipeline.tied``; the peer by a 2-rank
``all_reduce``), then AdamW steps. The printed per-step losses of the four
variants agree (~1e-7), so they compute the same thing.

**Throughput.** After ``--warmup`` untimed steps and one untimed, sampled
memory step per variant, ``--steps`` timed steps of each run round-robin,
each round in the next order of a carryover-balanced design
(``benchkit.paired.balanced_orders``: over every 4 rounds each variant runs
once in each slot and once right after each other one, so neither load
from other processes nor the variant before favours one): every rank waits on a barrier and times its step (schedule, tied
gradients, optimizer); a step's time is the max over ranks, a variant's the
median over its steps; tokens/s = batch x seq / that. ``cpu ms`` is the
same over each rank's process CPU time of the step (all its threads; one
intra-op thread per rank), which other jobs on the machine disturb less than
wall time: the ratio table gives throughput by both. A paired line also
gives, per pair, the median over rounds of each round's own ratio (the two
variants ran within seconds of each other) with its 90% bootstrap interval
(``benchkit.paired``).

**Memory.** Peak bytes of C heap in use (glibc ``mallinfo2``: in-use arena
plus mmapped chunks of every thread; torch's CPU tensors live there; RSS
where glibc is missing), sampled every ~0.2 ms by a thread during the memory
step, minus the heap in use when the step starts (parameters, AdamW state,
persistent buffers). That is what a step adds — saved activations, stage
outputs held for backward, gradients, boundary and receive buffers — without
RSS's noise (freed pages, allocator caching, other variants' leftovers).
MKL keeps ~12 MB of GEMM buffers per OS thread from its first matmul to the
thread's exit; our executor's queue threads and the peer's main thread both
live from warm-up on, so neither window contains them. Not
counted: buffers a runtime keeps across steps (the peer's ``m`` receive
buffers per direction, 2 MB per rank here). ``saved MB`` is exact and
counts activations only: the peak bytes of distinct non-parameter storages
that autograd saved for backward (``saved_tensors_hooks`` around each stage
forward and the loss). Ratios use the heap of the worst rank.

**Schedule.** Per stage, the bubble — the fraction of a step in which the
stage runs neither a forward nor a backward, ``runtime.pipeline.timeline
.bubble`` on ours' executor trace and on the peer's timed
``forward_one_chunk`` (+ loss) and ``backward_one_chunk``, median over the
timed steps — next to the theory ``(p-1)/(m+p-1)``; and the most
micro-batches held between forward and backward in the memory step.

**Where the time goes.** Per stage, the mean time of each action over the
timed steps and how often it runs per step: forward and backward per
micro-batch, the boundary actors (cut, assemble; send and receive, which
include waiting for the peer), the per-step gradient reduction (tied
gradients) and update (AdamW + zero_grad); then ours minus the peer's in ms
per step, and which action was running when each sampled step's heap
peaked.

**Trace.** ``--trace out.json`` also writes the last timed step of ``ours
1f1b`` and ``torch 1F1B`` as one Chrome trace, each variant's step shifted to
start at 0 so they line up (processes ``ours rank r`` and ``torch rank r``;
ours' tracks are the executor's threads, e.g. ``copy+network:0`` where a
boundary cut runs on its channel's thread; the peer's one: compute);
``python scripts/plot_trace.py out.json``
renders it side by side.

Last line: ``vs Schedule1F1B: X.XXx throughput, Y.YYx peak memory; vs
ScheduleGPipe: X.XXx, Y.YYx`` (ours / theirs: throughput above 1 and memory
below 1 favour ours).
"""

from __future__ import annotations

import json
import re
import statistics

from benchkit.paired import paired_ratio
from benchkit.pipeline_peers import (MB, SCHEDULE_TRACE, VARIANTS, pairs_of, parse, schedule_of, variants_of,
                                     worker)
from runtime.pipeline.timeline import bubble, peak_held, theory


_KIND = re.compile(r"^s\d+\.(F|B|W|data|reduce|update|act\.cut|act\.assemble|grad\.cut|grad\.assemble)")


def _kind(name: str) -> str:
    """An action's kind: ``F``, ``B``, ``act.cut``, ``send grad``, ... (``other`` for the rest)."""
    if name.startswith(("send:", "recv:")):
        way, src = name.split(":", 1)
        return f"{way} " + ("act" if ".act." in src else "grad" if ".grad." in src else "loss")
    m = _KIND.match(name)
    return m.group(1) if m else "other"


def _label(name: str, piece) -> str:
    """A trace event's name: ``F2 5`` (stage 2's forward of micro-batch 5; a colour per kind and stage), else
    the action's kind and piece."""
    m = re.match(r"^s(\d+)\.([FBW])@", name)
    return f"{m.group(2)}{m.group(1)} {piece}" if m else f"{_kind(name)} {piece}"


def _actions(per_step_events):
    """``{kind: (mean ms per action, actions per step)}`` and busy F+B seconds per step."""
    total, count, fb = {}, {}, 0.0
    for events in per_step_events:
        for name, start, end, _ in events:
            k = _kind(name)
            total[k] = total.get(k, 0.0) + (end - start)
            count[k] = count.get(k, 0) + 1
            if k in ("F", "B", "W"):
                fb += end - start
    n = len(per_step_events)
    return {k: (total[k] / count[k] * 1e3, count[k] / n) for k in total}, fb / n


def _running(mem) -> str:
    """The compute action (forward, backward, reduce, update) of the sampled step that ran at its heap peak."""
    when = mem["when"]
    for name, start, end, piece in mem["events"]:
        if start <= when <= end and _kind(name) in ("F", "B", "W", "reduce", "update"):
            return f"{_kind(name)}{piece if _kind(name) in ('F', 'B', 'W') else ''}"
    return "between actions"


def report(res, o) -> str:
    """The benchmark's text: per variant its step, memory and held micro-batches, the trace's actions, the
    bubble against theory, and the last line. One function: every line reads the same per-variant tables."""
    lines = []
    variants, pairs = variants_of(o), pairs_of(o)
    tokens = o.batch * o.seq
    step_time = {n: statistics.median(max(r["times"][n][k] for r in res) for k in range(o.steps)) for n in variants}
    cpu_time = {n: statistics.median(max(r["cpu"][n][k] for r in res) for k in range(o.steps)) for n in variants}
    mem = {n: max(r["mem"][n]["step"] for r in res) for n in variants}
    losses = {n: {i: x for r in res for i, x in r["losses"][n].items() if x is not None} for n in variants}
    ref = losses[variants[1]]
    worst = max(abs(losses[n][i] - ref[i]) / abs(ref[i]) for n in variants for i in ref)
    lines.append(f"GPT-2 {o.layers} layers x {o.embd} (vocab {o.vocab}), pp={o.pp}, m={o.micro}, "
                 f"batch {o.batch} x seq {o.seq} = {tokens} tokens/step, {o.steps} timed steps after {o.warmup}+1")
    lines.append(f"loss per step agrees across the {len(variants)} variants: max rel diff {worst:.1e} "
                 f"(step 0 loss {ref[0]:.4f}, last {ref[max(ref)]:.4f})")
    lines.append("")
    w = max(12, max(len(n) for n in variants))
    head = f"{'variant':{w}s} {'step ms':>9s} {'tokens/s':>9s} {'cpu ms':>7s}"
    for r in res:
        head += f" {'heap MB s' + str(r['stage']):>11s} {'saved MB s' + str(r['stage']):>12s}"
    lines.append(head)
    for n in variants:
        row = f"{n:{w}s} {step_time[n] * 1e3:9.0f} {tokens / step_time[n]:9.0f} {cpu_time[n] * 1e3:7.0f}"
        for r in res:
            row += f" {r['mem'][n]['step'] / MB:11.1f} {r['mem'][n]['saved'] / MB:12.1f}"
        lines.append(row)
    lines.append("")
    pw = max(14, max(len(f"{a[5:]} vs {b[6:]}") for a, b in pairs))
    lines.append(f"{'ours / torch':{pw}s} {'throughput':>10s} {'by CPU time':>11s} {'peak heap':>10s}")
    ratios = {}
    for ours, theirs in pairs:
        ratios[ours] = (step_time[theirs] / step_time[ours], mem[ours] / mem[theirs])
        lines.append(f"{ours[5:] + ' vs ' + theirs[6:]:{pw}s} {ratios[ours][0]:9.2f}x "
                     f"{cpu_time[theirs] / cpu_time[ours]:10.2f}x {ratios[ours][1]:9.2f}x")
    paired = []
    for ours, theirs in pairs:
        per_round = {n: [max(r["times"][n][k] for r in res) for k in range(o.steps)] for n in (ours, theirs)}
        mid, lo, hi = paired_ratio(per_round[theirs], per_round[ours])
        paired.append(f"{ours[5:]} vs {theirs[6:]} {mid:.2f}x (90% interval {lo:.2f}-{hi:.2f})")
    lines.append("paired, the median over rounds of each round's own ratio (drift between rounds cancels): "
                 + "; ".join(paired))
    lines.append("")
    virtuals = sorted({schedule_of(n.split()[1], o)[1] for n in variants})
    lines.append("per pipeline rank: bubble (median over the timed steps; 1F1B's theory (p-1)/(v m+p-1) = "
                 + ", ".join(f"{theory(o.pp, o.micro, v):.2f} for v={v}" for v in virtuals)
                 + ") and the most micro-batches (of any stage) held between forward and backward (or weight pass)")
    bubbles = {}
    for n in variants:
        per_step = [bubble({r["stage"]: r["events"][n][k] for r in res}) for k in range(o.steps)]
        med = {s: statistics.median(b[s] for b in per_step) for s in sorted(per_step[0])}
        bubbles[n] = statistics.mean(med.values())
        held = {r["stage"]: peak_held(r["mem"][n]["events"]) for r in res}
        lines.append(f"  {n:{w}s} bubble " + ", ".join(f"s{s} {x:.2f}" for s, x in med.items())
                     + f" (mean {bubbles[n]:.2f})   held " + ", ".join(f"s{s} {held[s]}" for s in sorted(held)))
    lines.append("")
    lines.append("where the time goes: ms per action, mean over the timed steps [actions per step]; "
                 "send/recv include waiting for the peer")
    order = ("F", "B", "W", "data", "act.cut", "act.assemble", "grad.cut", "grad.assemble", "send act", "recv act",
             "send grad", "recv grad", "reduce", "update", "send loss", "recv loss", "other")
    per_step = {}
    for n in variants:
        mean_step = statistics.mean(max(r["times"][n][k] for r in res) for k in range(o.steps))
        for r in sorted(res, key=lambda r: r["stage"]):
            acts, fb = _actions(r["events"][n])
            per_step[n, r["stage"]] = {k: acts[k][0] * acts[k][1] for k in acts}
            parts = [f"{k} {acts[k][0]:.1f}[{acts[k][1]:g}]" for k in order if k in acts]
            lines.append(f"  {n:{w}s} s{r['stage']}: F+B(+W) {fb * 1e3:.0f} of {mean_step * 1e3:.0f} ms/step; "
                         + " ".join(parts))
    lines.append("ours - torch, ms per step: " + "; ".join(
        f"{ours[5:]} s{st}: " + " ".join(f"{k} {per_step[ours, st].get(k, 0) - per_step[theirs, st].get(k, 0):+.0f}"
                                         for k in ("F", "B", "W", "reduce", "update"))
        for ours, theirs in pairs for st in range(o.pp)))
    lines.append("heap peak during (per stage, the compute action running when the sampled step's heap peaked):")
    for n in variants:
        lines.append(f"  {n:{w}s} " + "; ".join(f"s{r['stage']} {_running(r['mem'][n])}"
                                                for r in sorted(res, key=lambda r: r["stage"])))
    if o.schedules:
        (ti, mi), (tz, mz), (t2, m2), (tv, mv) = (ratios[ours] for ours, _ in pairs)
        lines.append(f"schedules: interleaved {ti:.2f}x thr {mi:.2f}x mem; zb {tz:.2f}x thr {mz:.2f}x mem; "
                     f"zb2 {t2:.2f}x thr {m2:.2f}x mem; zbv {tv:.2f}x thr {mv:.2f}x mem (vs torch)")
    else:
        (t1, m1), (tg, mg) = ratios["ours 1f1b"], ratios["ours gpipe"]
        lines.append(f"vs Schedule1F1B: {t1:.2f}x throughput, {m1:.2f}x peak memory; vs ScheduleGPipe: {tg:.2f}x, "
                     f"{mg:.2f}x")
    return "\n".join(lines)


def write_trace(res, path: str, pair=VARIANTS[:2]) -> str:
    """The variants' (``pair``: two or more) last timed step as one Chrome trace, each shifted to start at 0."""
    events = []
    for v, name in enumerate(pair):
        steps = [r["events"][name][-1] for r in res]
        t0 = min(start for evs in steps for _, start, _, _ in evs)
        for r, evs in zip(res, steps):
            pid = v * len(res) + r["stage"]
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{name} rank {r['stage']}"}})
            for ev_name, start, end, piece in evs:
                events.append({"ph": "X", "name": _label(ev_name, piece), "pid": pid,
                               "tid": r["threads"][name].get(ev_name, "compute"),
                               "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def main(argv=None) -> str:
    from toolkit.rank_pool import get_pool

    o = parse(argv, __doc__.split("\n")[0])
    res = get_pool(o.pp, timeout=120.0).run(worker, o, call_timeout=900.0)
    text = report(res, o)
    print(text, flush=True)
    if o.trace:
        shown = SCHEDULE_TRACE if o.schedules else VARIANTS[:2]
        print(f"trace of the last timed step: {write_trace(res, o.trace, shown)}")
    return text


if __name__ == "__main__":
    main()
