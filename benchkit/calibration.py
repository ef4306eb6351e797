"""This machine measured for the simulator's cluster file: cores' capacity under busy threads, the contention
of several processes, a gloo link, the sync and skew of collectives, per-op costs and host costs
(scripts/calibrate_machine.py writes them; scripts/verify_simulator.py and layout_timing re-measure them)."""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from benchkit.sync_probe import sync_latency
from runtime.host_memory import keep_freed_host_memory

ROOT = Path(__file__).resolve().parents[1]  # the project's root (configs/cluster lives there)


def op_cost_path(threads: int = 1) -> Path:
    from toolkit.search.opcost import measurement_cache

    return measurement_cache(threads)


def _spin(seconds: float, q) -> None:
    t0, c0, x = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        for i in range(20000):
            x += i
    q.put(time.process_time() - c0)


def capacity(ns=(1, 2, 4, 8), seconds: float = 1.5) -> list:
    """``[[n, cores used]]`` with ``n`` of our processes spinning at once."""
    ctx = mp.get_context("fork")
    out = []
    for n in ns:
        q = ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, q)) for _ in range(n)]
        for p in procs:
            p.start()
        cpu = [q.get() for _ in procs]
        for p in procs:
            p.join()
        # each spins ``seconds`` of wall time from its own start (starts are staggered: clamp to the cores)
        out.append([n, round(min(float(n), float(os.cpu_count() or n), sum(cpu) / seconds), 3)])
    return out


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def thread_speedup(costs=None) -> float:
    """2 intra-op threads vs 1 over the kernels of one step of the large calibration GPT-2 (scripts/calibrate_machine.py's docstring says why)."""
    from toolkit.search.opcost import MeasuredOpCosts
    from toolkit.search.threadgain import MeasuredThreadGain

    costs = costs or MeasuredOpCosts(op_cost_path(), threads=1)
    gains = MeasuredThreadGain(op_cost_path(2), threads=2)
    calls, _ = _rehearsed_step(_calibration_gpt(True), 2)
    one = sum(costs.seconds(c) for c in calls)
    two = sum(costs.seconds(c) / gains.gain(c) for c in calls)
    costs.save()
    gains.save()
    return round(one / two, 3) if two > 0 else 1.0


def memory_bandwidth() -> float:
    src, dst = torch.empty(16 << 20), torch.empty(16 << 20)
    src.normal_()
    t = _best(lambda: dst.copy_(src), 10)
    return round(2 * src.numel() * 4 / t / 1e9, 2)


def _host_run(conf, rows: int, costs) -> tuple:
    """``(CPU seconds of a real step, seconds of its kernels measured alone, global ops)`` for one GPT-2 config.

    The step is forward, backward and an AdamW update on a one-device
    placement (best of 20 by process CPU time); the kernels come from a
    rehearsal of the same step priced by ``costs``.
    """
    import sbp_core as sc

    p = sc.placement("cpu", [[0]])
    model, opt = _build_gpt(conf, p)
    ids = sc.to_global(torch.randint(0, conf.vocab_size, (rows, conf.n_positions)), placement=p,
                       sbp=(sc.sbp.split(0), sc.sbp.broadcast))
    _train_step(model, opt, ids)
    best = float("inf")
    for _ in range(20):
        c0 = time.process_time()
        _train_step(model, opt, ids)
        best = min(best, time.process_time() - c0)
    calls, n_ops = _rehearsed_step(conf, rows)
    return best, sum(costs.seconds(c) for c in calls), n_ops


def _build_gpt(conf, placement):
    """The GPT-2 of ``conf`` on ``placement`` with the recipe's plan, and its AdamW."""
    import sbp_core as sc
    from recipes.gpt2.model import GPT2LMHeadModel
    from recipes.gpt2.plan import mesh_plan
    from toolkit.mesh import model_names, plan_for_module

    torch.manual_seed(0)
    m = GPT2LMHeadModel(conf)
    m = sc.distribute_module(m, placement, plan_for_module(m, mesh_plan(), model_names(m)))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


def _train_step(model, opt, ids) -> None:
    _, loss = model(ids, ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _rehearsed_step(conf, rows: int) -> tuple:
    """``(local calls, global ops)`` of one one-device training step of ``conf`` (forward, backward, AdamW), rehearsed."""
    import sbp_core as sc
    from toolkit.search.rehearsal import Rehearsal
    from toolkit.search.stage_trace import global_input

    with Rehearsal(1) as r:
        p = sc.placement("cpu", [[0]])
        fmodel, fopt = _build_gpt(conf, p)
        fids = global_input((rows, conf.n_positions), torch.int64, p, (sc.sbp.split(0), sc.sbp.broadcast))
        _train_step(fmodel, fopt, fids)  # the optimizer's state exists from here on, as in the timed steps
        with r.phase("step") as ph:
            _train_step(fmodel, fopt, fids)
    return ph.calls, len(ph.global_ops)


def _calibration_gpt(large: bool):
    from recipes.gpt2.model import GPT2Config

    if large:  # big activations (its logits are 16 MB a micro-batch of 2), so kernels dominate
        return GPT2Config(vocab_size=8192, n_positions=256, n_embd=64, n_layer=1, n_head=2, embd_pdrop=0.0,
                          resid_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(vocab_size=512, n_positions=16, n_embd=64, n_layer=2, n_head=2, embd_pdrop=0.0,
                      resid_pdrop=0.0, attn_pdrop=0.0)


def _probe_step():
    """One-device training step of the large calibration GPT-2 (forward, backward, AdamW), warmed up."""
    import sbp_core as sc
    from recipes.gpt2.model import GPT2LMHeadModel

    conf = _calibration_gpt(True)
    p = sc.placement("cpu", [[0]])
    model = sc.distribute_module(GPT2LMHeadModel(conf), p, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = sc.to_global(torch.randint(0, conf.vocab_size, (2, conf.n_positions)), placement=p,
                       sbp=(sc.sbp.split(0), sc.sbp.broadcast))

    def step():
        model(ids, ids)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


def _contended_steps(barrier, q, steps: int) -> None:
    """One process of ``contention``: CPU seconds of each of ``steps`` training steps run alongside the others."""
    keep_freed_host_memory()  # as a training rank's host memory
    torch.set_num_threads(1)
    step = _probe_step()
    barrier.wait()
    cpus = []
    for _ in range(steps):
        c0 = time.process_time()
        step()
        cpus.append(time.process_time() - c0)
    q.put(statistics.median(cpus))


def contention(ns=(1, 2, 4, 8), steps: int = 6, base: float | None = None) -> tuple:
    """``([[n, CPU time per step with n processes stepping at once / base]], base)`` (one thread each).

    ``base``: the CPU seconds of one step alone on a quiet machine (``device.probe_step_s``
    of the cluster file); ``None`` takes this run's one-process step.
    """
    ctx = mp.get_context("spawn")
    out = []
    for n in ns:
        barrier, q = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_contended_steps, args=(barrier, q, steps)) for _ in range(n)]
        for p in procs:
            p.start()
        cpu = statistics.median(q.get() for _ in procs)
        for p in procs:
            p.join()
        base = base or cpu
        out.append([n, round(max(1.0, cpu / base), 3)])
    return out, base


def host_costs() -> tuple:
    """``(seconds per global op beyond its kernel, in-situ factor on measured kernel seconds)``.

    Two real single-device steps with one thread: a tiny GPT-2 whose kernels
    are negligible (dispatch dominates) and a larger one whose kernels
    dominate; ``cpu = factor * kernels + ops * dispatch`` for both gives the
    two numbers. Kernels measured alone run on warm caches and reused
    memory, so in a real step they take longer (``factor`` > 1).
    """
    from toolkit.search.opcost import MeasuredOpCosts

    torch.set_num_threads(1)
    costs = MeasuredOpCosts(op_cost_path(), threads=1)
    (ca, ka, na), (cb, kb, nb) = _host_run(_calibration_gpt(False), 1, costs), _host_run(_calibration_gpt(True), 2, costs)
    costs.save()
    # ca = f*ka + na*d, cb = f*kb + nb*d
    det = ka * nb - kb * na
    factor = (ca * nb - cb * na) / det if det else 1.0
    factor = max(1.0, factor)
    dispatch = max(0.0, (ca - factor * ka) / na)
    return dispatch, factor


def _link_worker(small_iters: int, big_iters: int, nbytes: int, busy: int = 0):
    """``(min, median)`` seconds of a 4-byte all-reduce round and the least of an ``nbytes`` one.

    ``busy`` > 0: each small round follows a ``busy``-sized matmul on both
    ranks, as training computes between messages, and the same matmul timed
    alone (interleaved) is subtracted: on a loaded machine the message then
    also waits for the peer that lost its core while computing, which an idle
    ping-pong never sees.
    """
    from sbp_core.boxing.collectives import all_reduce

    torch.set_num_threads(1)
    ranks = [0, 1]
    small, big = torch.zeros(1), torch.zeros(nbytes // 4)
    a = torch.randn(busy, busy) if busy else None
    for t in (small, big):
        all_reduce(t, ranks, "sum")
    lat, alone = [], []
    for _ in range(small_iters):
        if busy:
            t0 = time.perf_counter()
            a @ a
            alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if busy:
            a @ a
        all_reduce(small, ranks, "sum")
        lat.append(time.perf_counter() - t0)
    if busy:
        lat = [max(0.0, t - statistics.median(alone)) for t in lat]
    bw = []
    for _ in range(big_iters):
        t0 = time.perf_counter()
        all_reduce(big, ranks, "sum")
        bw.append(time.perf_counter() - t0)
    return min(lat), statistics.median(lat), min(bw)


def gloo_link(nbytes: int = 8 << 20, busy: int = 0, rounds: int = 200) -> dict:
    """Latency and bandwidth of a two-rank gloo ring all-reduce (``busy``: compute between messages, see ``_link_worker``)."""
    from toolkit.rank_pool import get_pool

    res = get_pool(2, timeout=120).run(_link_worker, rounds, 10, nbytes, busy)
    lat = max(r[1] for r in res)  # median round of a 2-step (ring) all-reduce of 4 bytes
    big = max(r[2] for r in res)
    latency = lat / 2  # ring all-reduce over 2 ranks: 2 steps
    bandwidth = nbytes / max(1e-9, big - 2 * latency)  # each rank sends 2(p-1)/p |T| = |T|
    return {"bandwidth_gbs": round(bandwidth / 1e9, 3), "latency_us": round(latency * 1e6, 1)}


def memory_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return 8.0


def calibrate(out: str, devices: int = 8) -> str:
    """Measure this machine and write its cluster file to ``out``; returns the text."""
    t0 = time.time()
    load = os.getloadavg()[0]
    cap = capacity()
    slow, probe = contention()
    bw = memory_bandwidth()
    fits = [host_costs() for _ in range(5)]  # the VM's CPU time is noisy (kernel_factor 1.1-1.5 under load): the median of five fits
    disp, factor = statistics.median(f[0] for f in fits), statistics.median(f[1] for f in fits)
    speed = thread_speedup()
    link = gloo_link()
    probed = sync_latency()
    sync, skew = [[p, us] for p, us, _ in probed], [[p, f] for p, _, f in probed]
    cores = os.cpu_count() or 1
    text = f"""# This machine, measured by scripts/calibrate_machine.py on {time.strftime('%Y-%m-%d %H:%M')}
# (load average {load:.1f} when it ran; rerun it on the machine you simulate).
# A device is one process of ours; the processes share {cores} cores. Per-op kernel
# times are measured on first use into {op_cost_path()}.
name: this-machine
nodes: 1
devices_per_node: {devices}
cores: {cores}
costs: measured
# [busy threads of ours, cores they got]: other jobs take the rest
capacity: {cap}
# [busy processes of ours, CPU time per step relative to one alone]: oversubscription and shared caches
contention: {slow}
# [processes of ours sharing the cores, latency of one message step in us] (benchkit/sync_probe.py)
sync: {sync}
# [processes of ours, wait of a collective per second of compute since the previous one] (benchkit/sync_probe.py)
skew: {skew}
device:
  kind: cpu-process
  memory_gib: {memory_gib()}
  memory_shared: true
  memory_bandwidth_gbs: {bw}
  dispatch_us: {disp * 1e6:.1f}
  kernel_factor: {factor:.3f}
  # 2 intra-op threads vs 1 on a calibration step's kernels (per-call gains: {op_cost_path(2)})
  thread_speedup: {speed}
  # CPU seconds of one contention-probe step alone (scripts/verify_simulator.py rescales contention by it)
  probe_step_s: {probe:.4f}
links:
  intra_node: {{bandwidth_gbs: {link['bandwidth_gbs']}, latency_us: {link['latency_us']}}}
"""
    Path(out).write_text(text)
    print(f"calibrated in {time.time() - t0:.0f} s -> {out}")
    return text
