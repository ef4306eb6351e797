"""Measured step times of training layouts on this machine, interleaved, for the simulator's checks.

``LayoutTimer(overrides).measure(strategies, rounds, steps)`` trains each
strategy with the real trainer (``toolkit.trainer.Job``, our data path,
the runtime's pipelined step) on a shared pool of local gloo ranks per
world size (``toolkit.rank_pool``; each rank gets the launcher's
``cores // processes`` intra-op threads) and times ``steps`` steps per
strategy per round, rounds interleaving all strategies so that other load
on the machine hits them alike. A step's wall time is the max over ranks
after a barrier; its CPU time the max over ranks of the process CPU time.
Each strategy's turn in a round starts with an untimed step (the pool's
ranks ran other strategies' jobs in between: their caches, allocator and
thread pool are another job's), and a round's value is the least of its
timed steps: other jobs on the machine only ever add to a step, so the
least is the step with the least of them, and it is what repeats from
round to round (a median of 3 steps keeps a step slowed by a burst of
load as soon as two of them were). A strategy's time is the median of its
rounds' values.
Before each round ``capacity()`` (``calibrate_machine``) measures how many
cores our busy threads get right now, ``link()`` the latency and bandwidth
of a two-rank gloo all-reduce between matmuls (under load mostly the wait
for a peer that lost its core), ``sync()`` the latency of a message step
with 2, 4 and 8 of our processes at once and the collectives' wait per second of compute
before them (``sync_probe``), and ``contention()`` how much CPU time
a fixed training step takes with 1-8 of our processes stepping at once,
relative to the calibration's quiet-machine value (other jobs slow the work
itself, not only our share of the cores).

A strategy reaches the trainer as its config (``parallel.*`` with the
per-op layouts in ``parallel.plan``, ``trainer.micro_batch_size``), exactly
as ``parallel=auto`` hands it over.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import torch

_JOBS: dict = {}


def _job(key, overrides, strategy_dict):
    if key not in _JOBS:
        from recipes.registry import get
        from toolkit.search.strategy import Strategy
        from toolkit.search.stage_spec import strategy_cfg
        from toolkit.config import compose
        from toolkit.trainer import Job

        base = compose(list(overrides) + ["logger=none", "trainer.eval_every=0", "trainer.max_steps=100000"],
                       run_dir=tempfile.mkdtemp())
        recipe = get(base.recipe.name)
        cfg = strategy_cfg(base, recipe, Strategy.from_dict(strategy_dict))
        _JOBS[key] = [Job(cfg, recipe), 0]
    return _JOBS[key]


def run_steps(key, overrides, strategy_dict, steps: int, threads: int) -> list:
    """On every rank: ``steps`` timed steps of the strategy's job; ``[(wall s, cpu s)]``."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    entry = _job(key, overrides, strategy_dict)
    job = entry[0]
    out = []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        job.pipe.step(entry[1])
        out.append((time.perf_counter() - t0, time.process_time() - c0))
        entry[1] += 1
    return out


@dataclasses.dataclass
class Timing:
    walls: list
    cpus: list
    round_walls: list = dataclasses.field(default_factory=list)  # the least step of each round

    @property
    def wall(self) -> float:
        """The median of the rounds' values (each the least of the round's steps)."""
        return statistics.median(self.round_walls)

    @property
    def spread(self) -> float:
        """How far apart the rounds' values are: ``(max - min) / median`` of them (0 with one round)."""
        return (max(self.round_walls) - min(self.round_walls)) / self.wall if self.round_walls else 0.0

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)


class LayoutTimer:
    def __init__(self, overrides, cores: int | None = None, timeout: float = 600.0, probe_step: float = 0.0):
        self.overrides = list(overrides)
        self.probe_step = probe_step  # > 0: also measure contention each round, relative to it
        self.contentions: list = []
        self.cores = cores or os.cpu_count() or 1
        self.timeout = timeout
        self.capacities: list = []  # one capacity curve per round
        self.links: list = []  # one gloo link probe per round (``calibrate_machine.gloo_link``)
        self.syncs: list = []  # one sync curve per round (``sync_probe.sync_latency``)

    def _run(self, strategy, steps):
        from toolkit.rank_pool import get_pool

        w = strategy.world
        res = get_pool(w, self.timeout).run(run_steps, repr(strategy), self.overrides, strategy.to_dict(), steps,
                                            max(1, self.cores // w))
        return [max(r[i][0] for r in res) for i in range(steps)], [max(r[i][1] for r in res) for i in range(steps)]

    def measure(self, strategies, rounds: int = 3, steps: int = 2, warmup: int = 1, log=print) -> dict:
        """``{strategy: Timing}`` over ``rounds`` interleaved rounds of ``warmup`` untimed and ``steps`` timed steps."""
        from benchkit.calibration import capacity, contention, gloo_link
        from benchkit.sync_probe import sync_latency

        out = {s: Timing([], []) for s in strategies}
        for s in strategies:
            t0 = time.time()
            self._run(s, warmup)  # builds the job (data, model, plan) and warms caches
            log(f"  built {s.describe()} in {time.time() - t0:.0f} s (load {os.getloadavg()[0]:.1f})")
        for r in range(rounds):
            self.capacities.append(capacity(seconds=1.5))
            # under load a message's latency is mostly the wait for a peer that lost its core while computing:
            # probe it as the load is now, with compute between the messages as in training
            self.links.append(gloo_link(busy=256, rounds=60))
            self.syncs.append(sync_latency(sorted({max(2, s.world + s.world % 2) for s in strategies})))
            if self.probe_step:
                self.contentions.append(contention(steps=3, base=self.probe_step)[0])
            order = strategies[r % len(strategies):] + strategies[: r % len(strategies)]
            for s in order:
                walls, cpus = self._run(s, steps + warmup)
                walls, cpus = walls[warmup:], cpus[warmup:]
                out[s].walls += walls
                out[s].round_walls.append(min(walls))
                out[s].cpus += cpus
            log(f"  round {r + 1}/{rounds} done (load {os.getloadavg()[0]:.1f}, capacity {self.capacities[-1]}, "
                f"link {self.links[-1]}, sync {self.syncs[-1]}"
                + (f", contention {self.contentions[-1]})" if self.contentions else ")"))
        return out

    def capacity(self) -> tuple:
        """The median over rounds of the cores our busy threads got, per thread count (made non-decreasing:
        more busy threads never get fewer cores, so a dip is a probe that other load hit)."""
        out, best = [], 0.0
        for n, c in _median_curve(self.capacities):
            best = max(best, c)
            out.append((n, best))
        return tuple(out)

    def link(self) -> dict:
        """The median over rounds of the two-rank gloo link's latency and bandwidth (``links.intra_node`` keys)."""
        return {k: statistics.median(r[k] for r in self.links) for k in ("bandwidth_gbs", "latency_us")}

    def sync(self) -> tuple:
        """The median over rounds of the message-step latency in microseconds, per processes sharing the cores."""
        return _median_curve([[(p, us) for p, us, _ in c] for c in self.syncs])

    def skew(self) -> tuple:
        """The median over rounds of a collective's wait per second of compute before it, per processes."""
        return _median_curve([[(p, f) for p, _, f in c] for c in self.syncs])

    def contention(self) -> tuple:
        """The median over rounds of the CPU time per unit of work (vs the calibration's), per busy processes."""
        return _median_curve(self.contentions)


def _median_curve(curves) -> tuple:
    if not curves:
        return ()
    ns = [n for n, _ in curves[0]]
    return tuple((n, statistics.median(c[i][1] for c in curves)) for i, n in enumerate(ns))
