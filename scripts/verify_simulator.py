"""The execution simulator against measured training steps on this machine, delta vs full, and the search's pick.

    python scripts/verify_simulator.py [--layouts single,dp2,...] [--rounds 3] [--steps 3] [--budget 60]

1. **Measured**: each layout of ``gpt2-tiny`` (default config: 16 sequences
   of 256 tokens per step, micro-batches of 4, AdamW, clipping) trains with
   the real trainer on local gloo ranks (``benchkit/layout_timing.py``):
   rounds interleave the layouts, each layout's turn in a round is an untimed
   step then ``steps`` timed ones (max over ranks), the round's value is the
   least of them and a layout's step time the median of its rounds' values
   (``layout_timing``: other load only adds to a step). How repeatable that is: each layout's *spread*
   (its rounds' values, ``(max - min) / median``) and the Spearman
   correlation between the rounds' rankings of the layouts (the best a
   prediction can hope for; with 3+ rounds, the least over pairs of rounds). Before each round the cores our
   busy threads get are measured (``capacity``: other jobs share the machine),
   the latency and bandwidth of a two-rank gloo all-reduce (``link``: under
   load a message mostly waits for its receiver to get a core), the latency
   of a message step with 2, 4 and 8 of our processes at once (``sync``: a
   peer off its core makes every step wait) and what a collective waits on
   top per second of compute before it (``skew``: ranks drift apart while
   computing; both ``benchkit/sync_probe.py``), and the CPU
   time a fixed probe step takes with 1-8 of our processes at once relative
   to its value alone at the start, measured with the per-op table (``contention``).
2. **Predicted**: the simulator (``toolkit.search``) on this machine's
   cluster file, calibrated first by ``scripts/calibrate_machine.py`` (into a
   scratch file; ``--cluster`` gives one instead)
   with the capacity, link, sync and contention measured in step 1 (medians) —
   rehearsed stages, per-op CPU seconds measured here before the rounds, on
   the quiet machine, each call again (``MeasuredOpCosts.refresh``; and
   per-op gains of 2 intra-op threads for one process, ``threadgain``),
   scaled by the model's own
   kernel factor (its plain one-device step over those per-op seconds,
   ``toolkit.search.kernel_factor``, in place of the cluster file's),
   its own cost per op on global tensors (its tp2 forward and backward on
   rank 0 of a fake world, less its kernels, per op,
   ``toolkit.search.dispatch_cost``, in place of ``dispatch_us``), the
   task graph of the runtime's actors, processor sharing of the cores. No
   layout's step time from step 1 enters a
   prediction. Also printed: the predicted and measured CPU seconds per rank.
3. **Delta vs full**: random per-op (per layer) layout changes of a tp2_pp2
   strategy, each predicted with full simulation and with delta simulation
   from the unchanged strategy; the timelines must be identical (every task's
   start and end); the speedup is full time / delta time, each the fastest
   of 5 passes over the changes, the way that goes first alternating, after
   an untimed pass of both (so both find the rehearsals and costs cached).
3b. **Out of sample**: the kernel factor and cost per op of step 2 are
   gpt2-tiny's, the model they were measured on (in sample). Two other
   models, a GPT-2 of another width and depth (2 layers of 256) and the tiny
   InsightFace (iresnet18-tiny), are measured as in step 1 and predicted with gpt2-tiny's
   figures (out of sample) and, beside that, with their own (in sample).
4. **Search**: Metropolis-Hastings over this machine's strategies (world
   sizes 1..8, degrees, ZeRO, micro-batch, sequence parallel, per-op
   layouts); the strategy it picks is measured again side by side with the
   two best measured layouts (interleaved rounds) and compared with the best.

Last line: ``simulator: in sample (gpt2-tiny) median error X%, spearman Y over N layouts; out of sample
gpt2 2x256 A% (in sample B%), insightface tiny C% (in sample D%); delta/full speedup Zx``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

LAYOUTS = "single,dp2,tp2,pp2,dp4,tp4,pp4,dp2_tp2,dp2_pp2,tp2_pp2,dp2_tp2_pp2"


def _strategy(name: str, micro: int):
    from toolkit.search.strategy import Strategy

    return Strategy.from_name(name, micro)


def delta_vs_full(model, evaluator, base_strategy, n: int, seed: int = 0, repeats: int = 5) -> tuple:
    """``(speedup, changes compared)``: full vs delta prediction time of ``n`` per-op changes; asserts identity.

    Every change is first predicted both ways, untimed (the rehearsals and per-op costs both use are then
    cached, and the timelines are compared); then the ``n`` changes are timed each way ``repeats`` times,
    the way that goes first alternating, and each way's fastest pass counts."""
    base = evaluator.predict(base_strategy)
    cands = model.op_changes(base_strategy, n, seed)
    for s in cands:
        full, delta = evaluator.predict(s), evaluator.predict(s, base=base)
        if full.timeline.tasks != delta.timeline.tasks or full.step_seconds != delta.step_seconds:
            raise AssertionError(f"delta simulation of {s.describe()} differs from the full one")
    best = {"full": float("inf"), "delta": float("inf")}
    ways = {"full": lambda s: evaluator.predict(s), "delta": lambda s: evaluator.predict(s, base=base)}
    for r in range(repeats):
        for way in (("full", "delta") if r % 2 == 0 else ("delta", "full")):
            t0 = time.perf_counter()
            for s in cands:
                ways[way](s)
            best[way] = min(best[way], time.perf_counter() - t0)
    return best["full"] / best["delta"], len(cands)


# Models the simulator is checked on out of sample: priced with the calibration model's (gpt2-tiny's) kernel
# factor and cost per op on global tensors, never their own. (config overrides, layouts, micro-batch rows)
OUT_OF_SAMPLE = {
    "gpt2 2x256": (["model=gpt2-tiny", "model.n_layer=2", "model.n_embd=256", "model.n_head=8"],
                   "single,dp2,tp2,pp2", 4),
    "insightface tiny": (["recipe=insightface", "trainer.global_batch_size=64", "trainer.micro_batch_size=16"],
                         "single,dp2,dp2_tp2", 16),
}


def _errors(ev, model, names, strategies, measured) -> list:
    """Per layout ``(name, measured s, predicted s, relative error)``."""
    rows = []
    for n, s in zip(names, strategies):
        p = ev.predict(s)
        rows.append((n, measured[s].wall, p.step_seconds, (p.step_seconds - measured[s].wall) / measured[s].wall))
    return rows


def round_agreement(measured, strategies) -> float:
    """The least Spearman correlation between two rounds' rankings of the layouts (nan with one round)."""
    rounds = len(measured[strategies[0]].round_walls)
    pairs = [(i, j) for i in range(rounds) for j in range(i + 1, rounds)]
    if not pairs:
        return float("nan")
    return min(spearman([measured[s].round_walls[i] for s in strategies],
                        [measured[s].round_walls[j] for s in strategies]) for i, j in pairs)


def _ranks(values) -> list:
    """1-based ranks of ``values``, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (nan when either side is constant)."""
    ra, rb = _ranks(list(a)), _ranks(list(b))
    if len(set(ra)) < 2 or len(set(rb)) < 2:
        return float("nan")
    return statistics.correlation(ra, rb)


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=60, help="search proposals")
    ap.add_argument("--changes", type=int, default=20, help="per-op changes timed for delta vs full")
    ap.add_argument("--cluster", default=None, help="a measured cluster file (default: calibrate this machine now)")
    return ap.parse_args()


def _calibrated(o, model, costs):
    """The cluster file (measured now unless given), with gpt2-tiny's own kernel factor and cost per global op."""
    from benchkit.calibration import calibrate
    from toolkit.search.cluster_file import load_cluster
    from toolkit.search.dispatch_cost import model_host_costs

    if o.cluster is None:  # the machine as it is now (scripts/calibrate_machine.py, into a scratch file)
        o.cluster = os.path.join(tempfile.mkdtemp(), "this_machine.yaml")
        print("calibrating this machine (scripts/calibrate_machine.py)")
        calibrate(o.cluster)
    calibrated = load_cluster(o.cluster)
    # This model's kernels inside its own plain step against measured alone, and its cost per op on global
    # tensors in its own tensor-parallel forward and backward (toolkit.search.dispatch_cost), in place of
    # the calibration GPT-2s' fit: gpt2-tiny's calls summed alone to 1.25-4x their in-step time, and its tp
    # stages took 25-70% more CPU than kernels plus 13.9 us an op.
    factor, dispatch = model_host_costs(model, costs, o.micro)
    print(f"kernel factor of {model.cfg.model.name} (its plain step over its calls measured alone): {factor:.3f} "
          f"(cluster file: {calibrated.kernel_factor:.3f}); dispatch per global op in its tp2 forward and "
          f"backward: {dispatch * 1e6:.1f} us (cluster file: {calibrated.host_overhead * 1e6:.1f} us)")
    return dataclasses.replace(calibrated, kernel_factor=factor, host_overhead=dispatch)


def _measured_cluster(o, overrides, strategies, calibrated):
    """Measure the layouts in interleaved rounds; ``(timer, measured, cluster with the rounds' capacity,
    contention, link, sync and skew, probe step)``."""
    from benchkit.calibration import contention
    from benchkit.layout_timing import LayoutTimer
    from toolkit.search.cluster import GB, Link

    print(f"measuring {len(strategies)} layouts ({o.rounds} rounds x {o.steps} steps, interleaved)")
    # The rounds' contention is relative to the probe step alone on the quiet machine: measured now, with the
    # per-op table and the kernel factor, not the cluster file's (a base measured slower than today's
    # clamps every contention to 1.0). The least of three: other load only adds to it.
    probe_step = min(contention(ns=(1,), steps=6)[1] for _ in range(3))
    print(f"contention probe step alone: {probe_step * 1e3:.1f} ms of CPU (cluster file: "
          f"{calibrated.probe_step * 1e3:.1f} ms)")
    timer = LayoutTimer(overrides, probe_step=probe_step)
    measured = timer.measure(strategies, o.rounds, o.steps)
    cap, slow, sync, skew = timer.capacity(), timer.contention(), timer.sync(), timer.skew()
    link = timer.link()
    intra = Link(link["bandwidth_gbs"] * GB, link["latency_us"] * 1e-6)
    cluster = dataclasses.replace(calibrated, capacity=cap, contention=slow or calibrated.contention, intra=intra,
                                  inter=intra, sync=tuple((n, us * 1e-6) for n, us in sync) or calibrated.sync,
                                  skew=skew or calibrated.skew)
    print(f"capacity used for predictions (busy threads -> cores, median of rounds): {list(cap)}")
    print(f"contention used (busy processes -> CPU time per unit of work vs the probe step alone): "
          f"{list(cluster.contention)}")
    print(f"link used (two-rank gloo all-reduce, median of rounds): {link}")
    print(f"sync used (processes -> us per message step, median of rounds): {[[n, round(us, 1)] for n, us in sync]}")
    print(f"skew used (processes -> a collective's wait per second of compute before it, median of rounds): "
          f"{[[n, round(f, 3)] for n, f in skew]}")
    return timer, measured, cluster, probe_step


def _in_sample(names, strategies, ev, model, measured, cluster) -> tuple:
    """Print each layout's measured and predicted step; ``(median |error|, spearman)``."""
    from benchkit.calibration import op_cost_path

    rows, errs, pred_t, meas_t = [], [], [], []
    for n, s in zip(names, strategies):
        p = ev.predict(s)
        m = model.micro_batches(s)
        work = max(w.forward * m + w.backward_first + w.backward * (m - 1) + w.reduce + w.update for w in p.works)
        mt = measured[s]
        err = (p.step_seconds - mt.wall) / mt.wall
        errs.append(abs(err))
        pred_t.append(p.step_seconds)
        meas_t.append(mt.wall)
        rows.append((n, mt.wall, p.step_seconds, err, mt.cpu, work, p.peak_memory / 2**20, mt.spread))
        if cluster.threads_per_device(s.world) > 1:  # what the per-call thread gains make of this layout
            print(f"{n}: {cluster.threads_per_device(s.world)} intra-op threads per process keep "
                  f"{p.works[0].weight / (s.dp * s.tp):.2f} busy on average (per-call gains, {op_cost_path(2).name})")
    print(f"\n{'layout':14s} {'measured s':>10s} {'spread':>6s} {'predicted s':>11s} {'error':>7s} {'cpu s/rank':>10s} "
          f"{'pred cpu s':>10s} {'pred MiB':>8s}")
    for n, mw, pw, e, mc, pc, mem, sp in rows:
        print(f"{n:14s} {mw:10.3f} {sp:6.0%} {pw:11.3f} {e:+7.0%} {mc:10.3f} {pc:10.3f} {mem:8.0f}")
    med = statistics.median(errs)
    rho = spearman(pred_t, meas_t)
    spreads = [r[-1] for r in rows]
    print(f"median |error| {med:.1%}, spearman {rho:.3f}")
    print(f"measurement: median spread of a layout's rounds {statistics.median(spreads):.0%} (max "
          f"{max(spreads):.0%}); round-to-round spearman {round_agreement(measured, strategies):.3f}")
    return med, rho


def _out_of_sample(o, cluster, costs, gains, probe_step) -> dict:
    """Other models, priced with gpt2-tiny's kernel factor and per-op cost (``cluster``) and, beside them, with
    their own (in sample), to show what the calibration model costs; ``{label: (out, in) median |error|}``."""
    from benchkit.layout_timing import LayoutTimer
    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.search.dispatch_cost import model_host_costs
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.search_model import RecipeSearchModel

    out = {}
    for label, (overrides_b, layouts_b, micro_b) in OUT_OF_SAMPLE.items():
        cfg_b = compose(overrides_b, run_dir="/tmp/verify_simulator")
        model_b = RecipeSearchModel(get(cfg_b.recipe.name), cfg_b)
        names_b = layouts_b.split(",")
        strategies_b = [_strategy(n, micro_b) for n in names_b]
        own = dataclasses.replace(cluster, **dict(zip(("kernel_factor", "host_overhead"),
                                                       model_host_costs(model_b, costs, micro_b))))
        for st in strategies_b:  # price before measuring, on the quieter machine (as above)
            Evaluator(model_b, cluster, costs, gains).predict(st)
        measured_b = LayoutTimer(overrides_b, probe_step=probe_step).measure(strategies_b, o.rounds, o.steps,
                                                                            log=lambda *_: None)
        outside = _errors(Evaluator(model_b, cluster, costs, gains), model_b, names_b, strategies_b, measured_b)
        inside = _errors(Evaluator(model_b, own, costs, gains), model_b, names_b, strategies_b, measured_b)
        print(f"\n{label} (calibrated on gpt2-tiny: out of sample; on itself: in sample)")
        print(f"{'layout':14s} {'measured s':>10s} {'out-of-sample s':>15s} {'error':>7s} {'in-sample s':>11s} "
              f"{'error':>7s}")
        for (n, mw, po, eo), (_, _, pi, ei) in zip(outside, inside):
            print(f"{n:14s} {mw:10.3f} {po:15.3f} {eo:+7.0%} {pi:11.3f} {ei:+7.0%}")
        out[label] = (statistics.median(abs(r[3]) for r in outside), statistics.median(abs(r[3]) for r in inside))
    return out


def _search_pick(o, model, cluster, ev, timer, names, strategies, measured) -> None:
    """Search, then measure its pick side by side with the two best measured layouts."""
    from toolkit.search.mcmc import search
    from toolkit.search.space import SearchSpace

    space = SearchSpace(model, cluster.devices, all_devices=False)
    t0 = time.time()
    res = search(space, ev, budget=o.budget, devices_per_node=cluster.devices_per_node, progress=False)
    pick = res.best.strategy
    print(f"search ({o.budget} proposals, {time.time() - t0:.0f} s, {model.rehearsals} stage rehearsals): "
          f"{pick.describe()}, predicted {res.best.step_seconds:.3f} s")
    # The pick against the best measured layouts, measured again side by side (load drifts between batches).
    ranked = sorted(zip(names, strategies), key=lambda ns: measured[ns[1]].wall)[:2]
    again = timer.measure(list(dict.fromkeys([pick] + [s for _, s in ranked])), o.rounds, o.steps,
                          log=lambda *_: None)
    best_name, best = min(((n, again[s].wall) for n, s in ranked), key=lambda x: x[1])
    got = again[pick].wall
    print(f"search pick measured {got:.3f} s vs best measured layout {best_name} {best:.3f} s (side by side): "
          f"{(got - best) / best:+.1%} ({'within' if got <= 1.10 * best else 'NOT within'} 10%)")


def main() -> None:
    o = _parse()
    from runtime.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # per-op costs measured with a training rank's host memory
    t_start = time.time()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")

    from benchkit.calibration import op_cost_path
    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.opcost import MeasuredOpCosts
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.search.threadgain import MeasuredThreadGain

    overrides = ["model=gpt2-tiny"]
    cfg = compose(overrides, run_dir="/tmp/verify_simulator")
    model = RecipeSearchModel(get(cfg.recipe.name), cfg)
    names = o.layouts.split(",")
    strategies = [_strategy(n, o.micro) for n in names]
    # Per-op costs measured now on the quiet machine, like the kernel factor (MeasuredOpCosts.refresh):
    # entries of the shared cache were each measured under whatever load there was then, and one factor
    # cannot undo a bias that differs from call to call.
    costs = MeasuredOpCosts(op_cost_path(), threads=1, refresh=True)
    gains = MeasuredThreadGain(op_cost_path(2), threads=2)
    calibrated = _calibrated(o, model, costs)
    # Price every layout once now, on the quiet machine: the per-op seconds and thread gains a prediction
    # needs are measured here (or found in the caches) rather than after the rounds, whose processes keep
    # the load up for minutes (gains measured then came out low: single's 1.27 busy threads against the
    # 1.68 its steps used). The predictions below reuse them with the probes of the rounds.
    t0 = time.time()
    warm = Evaluator(model, calibrated, costs, gains)
    for s in strategies:
        warm.predict(s)
    costs.save()
    gains.save()
    print(f"priced {len(names)} layouts before the rounds ({time.time() - t0:.0f} s; per-op costs measured, thread "
          f"gains measured or cached, load {os.getloadavg()[0]:.2f})")
    timer, measured, cluster, probe_step = _measured_cluster(o, overrides, strategies, calibrated)
    ev = Evaluator(model, cluster, costs, gains)
    med, rho = _in_sample(names, strategies, ev, model, measured, cluster)
    costs.save()
    gains.save()
    speedup, n_changes = delta_vs_full(model, ev, _strategy("tp2_pp2", o.micro), o.changes)
    print(f"delta vs full simulation: identical timelines for {n_changes} per-op changes of tp2_pp2; "
          f"speedup {speedup:.1f}x (fastest of 5 alternating passes each, caches warm for both)")
    out_of_sample = _out_of_sample(o, cluster, costs, gains, probe_step)
    costs.save()
    gains.save()
    _search_pick(o, model, cluster, ev, timer, names, strategies, measured)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; took {time.time() - t_start:.0f} s")
    print("simulator: in sample (gpt2-tiny) median error " + f"{med:.0%}, spearman {rho:.2f} over {len(names)} "
          "layouts; out of sample " + ", ".join(f"{k} {v[0]:.0%} (in sample {v[1]:.0%})"
                                                for k, v in out_of_sample.items())
          + f"; delta/full speedup {speedup:.1f}x")


if __name__ == "__main__":
    main()
