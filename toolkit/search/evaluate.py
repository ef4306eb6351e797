"""Predicting a strategy: rehearsed stages priced on a cluster, simulated as a task graph, with memory.

``Evaluator(model, cluster, op_costs).predict(strategy)`` returns a
``Prediction``: the simulated step time, each pipeline rank's peak memory
per device and whether it fits. The strategy's schedule and stages per
rank (``Strategy.schedule``, ``virtual``) shape the task graph, as they
shape the runtime's plan. ``predict(strategy, base=previous)`` is the
*delta* path: stages whose rehearsal is the same object as in ``base``
(``model.trace`` caches them, keyed by what a stage sees of the strategy)
keep their priced works, and the task graph is re-simulated only from the
first time a changed stage acted (``simulator.resimulate``); the result is
identical to the full path.

``model`` is what the layer that knows the recipe provides
(``toolkit.search.search_model``): ``micro_batches(strategy)``,
``grad_clip``, ``trace(strategy, stage) -> StageTrace`` and
``tied_bytes(strategy) -> int | None``.

Memory of a pipeline rank's device: parameters, gradients and optimizer
state of its stages as rehearsed (ZeRO's shards included), plus the
activation stashes its budget lets it hold (``stash_budget``, at most
``v m``: that many less one whole stashes of its largest stage, and the
working set of one forward or backward on top), plus the registers of
boundary activations its stages receive.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.pipeline.schedule import stash_budget

from .costmodel import collective_seconds, phase_cost
from .rehearsal import Collective
from .simulator import Timeline, resimulate, simulate
from .taskgraph import StageWork, pipeline_graph


@dataclass
class Prediction:
    strategy: object
    step_seconds: float
    memory: list  # peak bytes per device of each pipeline rank
    capacity: float  # bytes a device may hold
    works: list  # StageWork per stage
    traces: list  # StageTrace per stage
    timeline: Timeline
    graph: object

    @property
    def fits(self) -> bool:
        return max(self.memory) <= self.capacity

    @property
    def peak_memory(self) -> int:
        return max(self.memory)


class Evaluator:
    """``thread_gains``: per-call speedups of a process's intra-op threads (``threadgain.MeasuredThreadGain``),
    used for every strategy whose processes have cores to spare; ``None``: the cluster's ``thread_speedup``."""

    def __init__(self, model, cluster, op_costs, thread_gains=None):
        self.model, self.cluster, self.op_costs, self.thread_gains = model, cluster, op_costs, thread_gains

    def stage_devices(self, strategy, stage: int) -> tuple:
        """The devices of stage ``stage``: its pipeline rank's ``(dp, tp)`` mesh."""
        n, r = strategy.dp * strategy.tp, strategy.stage_rank(stage)
        return tuple(range(r * n, (r + 1) * n))

    def stage_work(self, strategy, stage: int, trace) -> StageWork:
        c = self.cluster
        devices = self.stage_devices(strategy, stage)
        threads, world = c.threads_per_device(strategy.world), strategy.world
        gains = self.thread_gains if threads > 1 else None
        priced = {name: phase_cost(trace.phases[name], self.op_costs, c, devices[0], devices, threads, gains, world,
                                 trace.plain)
                  for name in ("F", "B0", "B", "reduce", "update")}
        costs = {name: p.seconds for name, p in priced.items()}
        send = copy = 0.0
        if stage < strategy.stages - 1 and trace.act_bytes:
            peer = self.stage_devices(strategy, stage + 1)[0]
            send = collective_seconds(Collective("send", (0, 1), trace.act_bytes), c, (devices[0], peer), devices,
                                      world)
            copy = trace.act_bytes / c.mem_bandwidth if c.mem_bandwidth else 0.0
        # Threads a process keeps busy on average: its one-thread work over its time (a kernel sped up g-fold
        # keeps g threads busy; dispatch, small kernels and collectives one).
        total = sum(p.seconds for p in priced.values())
        busy = sum(p.thread_seconds for p in priced.values()) / total if total > 0 else 1.0
        weight = len(devices) * busy if c.cores else 0.0
        return StageWork(costs["F"], costs["B0"], costs["B"], costs["reduce"], costs["update"], send, copy, weight)

    def memory(self, strategy, rank: int, traces: list, m: int) -> int:
        """Peak bytes on a device of pipeline rank ``rank``, whose stages' rehearsals are ``traces``
        (``{stage: StageTrace}``)."""
        held = stash_budget(strategy.schedule, strategy.pp, strategy.virtual, rank, m)
        fixed = working = stash = received = 0
        for stage, trace in traces.items():
            ph = trace.phases
            fixed += trace.param_bytes + trace.grad_bytes + trace.optimizer_bytes
            working = max(working, ph["F"].peak_bytes,
                          trace.stash_bytes + max(ph["B0"].peak_bytes, ph["B"].peak_bytes))
            stash = max(stash, trace.stash_bytes)
            received += 2 * trace.act_bytes if stage > 0 else 0
        return fixed + (held - 1) * stash + working + received

    def _tied_seconds(self, strategy):
        nbytes = self.model.tied_bytes(strategy)
        if nbytes is None or strategy.pp == 1:
            return None
        first, last = self.stage_devices(strategy, 0), self.stage_devices(strategy, strategy.stages - 1)
        return collective_seconds(Collective("send", (0, 1), nbytes), self.cluster, (first[0], last[0]), first,
                                  strategy.world)

    def graph(self, strategy, works: list):
        m = self.model.micro_batches(strategy)
        rate = self.cluster.thread_rate if self.cluster.cores else None
        return pipeline_graph(works, m, strategy.schedule, tied=self._tied_seconds(strategy),
                              clip=bool(self.model.grad_clip), rate=rate, virtual=strategy.virtual,
                              weight_passes=not (strategy.zero and strategy.dp > 1))

    def predict(self, strategy, base: Prediction | None = None) -> Prediction:
        m = self.model.micro_batches(strategy)
        traces = [self.model.trace(strategy, s) for s in range(strategy.stages)]
        same_shape = base is not None and _structure(base.strategy) == _structure(strategy)
        works = [base.works[s] if same_shape and base.traces[s] is tr else self.stage_work(strategy, s, tr)
                 for s, tr in enumerate(traces)]
        graph = self.graph(strategy, works)
        if same_shape:
            changed = [a.name for a, b in zip(graph.actors, base.graph.actors) if a.work != b.work]
            timeline = resimulate(base.timeline, graph, changed) if changed else base.timeline
        else:
            timeline = simulate(graph)
        memory = [self.memory(strategy, r, {s: tr for s, tr in enumerate(traces) if strategy.stage_rank(s) == r}, m)
                  for r in range(strategy.pp)]
        capacity = self.cluster.device_memory(strategy.world)
        return Prediction(strategy, timeline.makespan, memory, capacity, works, traces, timeline, graph)


def _structure(strategy) -> tuple:
    """What fixes the task graph's shape (everything but per-op choices)."""
    return (strategy.dp, strategy.tp, strategy.pp, strategy.zero, strategy.micro_batch_size,
            strategy.sequence_parallel, strategy.schedule, strategy.virtual)
