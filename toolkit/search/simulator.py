"""Execution simulator: a task graph of actors run the way our runtime runs them, full or delta.

A ``TaskGraph`` lists actors with the runtime's semantics
(``runtime.executor``/``runtime.actor``): an actor acts on piece ``k`` when
every input edge holds a readable register and one of its ``quota`` out
registers is free; its register is freed when every consumer has finished
the action that read it (an edge reading ``every`` > 1 pieces at once takes
and frees each register as it arrives, as the runtime's accumulating edges
do). One actor runs at a time per queue; among ready actors the highest
``priority`` goes first, ties to the one listed first; an actor in a
``pool`` (``TaskGraph.pools``) also needs more free slots of it than its
``reserve``, and each of its registers holds one until freed
(``runtime.actor.Pool``); ``credits`` pre-fill ``n`` registers of a
producer for a consumer, as the runtime's (``ActorSpec.credits``) — so 1F1B (or GPipe)
comes out of the stash quota exactly as in training, not from a schedule.

Time: each piece of an actor needs ``work`` seconds at full speed. On a
machine whose devices have their own processors every running task goes at
speed 1. When devices share cores (processes on a CPU), running actors
with ``weight`` w (the threads each keeps busy) share them: with ``n``
busy threads each runs at ``rate(n)`` (``Cluster.thread_rate``: processor
sharing of the cores other jobs leave us, slowed by the contention of
oversubscribed cores); actors of weight 0 always go at speed 1.

``simulate(graph)`` runs the whole graph (*full* simulation) and returns a
``Timeline`` that also keeps snapshots of the simulator's state.
``resimulate(old, graph, changed)`` is the *delta* simulation (FlexFlow's
idea, exact here): when only the works of the ``changed`` actors differ,
everything before the first time one of them started is the same as
before, so it restarts from the last snapshot taken before that time. The
simulation is deterministic, so both give identical timelines (tested).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimActor:
    """One actor. ``work``: seconds per piece at full speed, or a list of them (one per piece)."""

    name: str
    queue: str
    work: object
    inputs: tuple = ()
    quota: int = 2
    priority: int = 0
    every: int = 1
    weight: float = 0.0
    pool: str = ""
    reserve: int = 0
    credits: dict = field(default_factory=dict)  # producer -> registers readable before it ran

    def work_of(self, k: int) -> float:
        w = self.work
        return float(w[k]) if isinstance(w, (list, tuple)) else float(w)


@dataclass
class TaskGraph:
    actors: list
    pieces: int
    rate: object = None  # speed of each busy thread given how many are busy (shared cores); None: no sharing
    pools: dict = field(default_factory=dict)  # pool name -> slots (SimActor.pool)

    def by_name(self) -> dict:
        return {a.name: a for a in self.actors}


@dataclass
class Timeline:
    """``tasks``: ``(actor, piece, start, end)`` in start order; ``makespan``: the last end."""

    tasks: list
    makespan: float
    raw: list = field(default_factory=list, repr=False)  # tasks in finishing order (snapshots index into it)
    snapshots: list = field(default_factory=list, repr=False)  # (time, state) before the event at time
    first_start: dict = field(default_factory=dict, repr=False)  # actor -> earliest start


class _State:
    """Everything the event loop mutates. A snapshot (``copy``) keeps ``tasks`` as a count: the list only grows."""

    __slots__ = ("t", "remaining", "next_piece", "free", "readable", "pending", "running", "tasks", "done", "pool")

    def copy(self, tasks=None):
        """A snapshot; with ``tasks`` (the finished tasks so far), a live state restored from one."""
        s = _State()
        s.t = self.t
        s.remaining = dict(self.remaining)
        s.next_piece = dict(self.next_piece)
        s.free = dict(self.free)
        s.pool = dict(self.pool)
        s.readable = {k: list(v) for k, v in self.readable.items()}
        s.pending = dict(self.pending)
        s.running = {q: list(r) for q, r in self.running.items()}
        s.tasks = len(self.tasks) if tasks is None else list(tasks[: self.tasks])
        s.done = self.done
        return s


class _Sim:
    def __init__(self, graph: TaskGraph):
        self.g = graph
        self.actors = graph.actors
        names = [a.name for a in self.actors]
        if len(set(names)) != len(names):
            raise ValueError(f"actor names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        self.by = {a.name: a for a in self.actors}
        for a in self.actors:
            for src in a.inputs:
                if src not in self.by:
                    raise ValueError(f"actor {a.name!r} reads {src!r}, which is no actor")
                if a.every % self.by[src].every:
                    raise ValueError(f"actor {a.name!r} (every {a.every}) reads {src!r} (every "
                                     f"{self.by[src].every}): every must be a multiple of its producers'")
            if a.pool and a.pool not in graph.pools:
                raise ValueError(f"actor {a.name!r}: pool {a.pool!r} is not one of {sorted(graph.pools)}")
            if graph.pieces % a.every:
                raise ValueError(f"{graph.pieces} pieces are not a multiple of every={a.every} of {a.name!r}")
        self.need = {a.name: [a.every // self.by[s].every for s in a.inputs] for a in self.actors}
        self.consumers = {a.name: [] for a in self.actors}
        for a in self.actors:
            for e, src in enumerate(a.inputs):
                self.consumers[src].append((a.name, e))
        self.queues: dict = {}
        for a in self.actors:
            self.queues.setdefault(a.queue, []).append(a)
        self.queue_order = sorted(self.queues)

    def initial(self) -> _State:
        s = _State()
        s.t = 0.0
        s.remaining = {a.name: self.g.pieces // a.every for a in self.actors}
        s.next_piece = {a.name: 0 for a in self.actors}
        s.free = {a.name: a.quota for a in self.actors}
        s.pool = dict(self.g.pools)
        # readable[(consumer, edge)]: producer register ids (piece numbers) waiting to be read
        s.readable = {(a.name, e): [] for a in self.actors for e in range(len(a.inputs))}
        s.pending = {}  # (producer, piece) -> consumers still to finish reading it
        for a in self.actors:  # credits: registers of the producer, readable before it ran
            for e, src in enumerate(a.inputs):
                for i in range(a.credits.get(src, 0)):
                    s.readable[(a.name, e)].append(-1 - i)
                    s.pending[(src, -1 - i)] = 1
                    s.free[src] -= 1
        s.running = {}  # queue -> [actor, piece, remaining work, start, read registers]
        s.tasks = []
        s.done = 0
        return s

    def _ready(self, s: _State, a: SimActor) -> bool:
        if s.remaining[a.name] <= 0 or s.free[a.name] <= 0:
            return False
        if a.pool and s.pool[a.pool] <= a.reserve:
            return False
        need = self.need[a.name]
        return all(len(s.readable[(a.name, e)]) >= n for e, n in enumerate(need))

    def _start_ready(self, s: _State) -> None:
        for q in self.queue_order:
            if q in s.running:
                continue
            best = None
            for a in self.queues[q]:
                if (best is None or a.priority > best.priority) and self._ready(s, a):
                    best = a
            if best is None:
                continue
            a = best
            piece = s.next_piece[a.name]
            reads = []
            for e, n in enumerate(self.need[a.name]):
                regs = s.readable[(a.name, e)]
                taken, s.readable[(a.name, e)] = regs[:n], regs[n:]
                if n == 1:
                    reads.append((a.inputs[e], taken[0]))  # freed when this action ends
                # accumulating edges were acknowledged on arrival
            s.free[a.name] -= 1
            if a.pool:
                s.pool[a.pool] -= 1
            s.next_piece[a.name] += 1
            s.running[q] = [a, piece, a.work_of(piece), s.t, reads]

    def _rate(self, s: _State, a: SimActor) -> float:
        if a.weight <= 0 or self.g.rate is None:
            return 1.0
        return self.g.rate(sum(r[0].weight for r in s.running.values()))

    def _finish(self, s: _State, q: str) -> None:
        a, piece, _, start, reads = s.running.pop(q)
        s.tasks.append((a.name, piece, start, s.t))
        s.remaining[a.name] -= 1
        s.done += 1
        cons = self.consumers[a.name]
        if not cons:
            self._release(s, a.name)
        else:
            s.pending[(a.name, piece)] = sum(1 for c, e in cons if self.need[c][e] == 1)
            for c, e in cons:
                s.readable[(c, e)].append(piece)
            if s.pending[(a.name, piece)] == 0:  # only accumulating consumers: taken on arrival
                del s.pending[(a.name, piece)]
                self._release(s, a.name)
        for src, reg in reads:
            key = (src, reg)
            s.pending[key] -= 1
            if s.pending[key] == 0:
                del s.pending[key]
                self._release(s, src)

    def _release(self, s: _State, name: str) -> None:
        """A register of ``name`` is free again, with its pool slot if any."""
        s.free[name] += 1
        pool = self.by[name].pool
        if pool:
            s.pool[pool] += 1

    def run(self, s: _State, snapshots: list, every: int = 1) -> _State:
        total = sum(self.g.pieces // a.every for a in self.actors)
        events = 0
        while True:
            if snapshots is not None and events % every == 0:
                snapshots.append((s.t, s.copy()))
            events += 1
            self._start_ready(s)
            if not s.running:
                break
            steps = {}
            for q, r in s.running.items():
                rate = self._rate(s, r[0])
                steps[q] = (r[2] / rate if r[2] > 0 else 0.0, rate)
            dt = min(v[0] for v in steps.values())
            s.t += dt
            finished = [q for q in sorted(s.running) if steps[q][0] == dt]
            for q, r in s.running.items():
                if q not in finished:
                    r[2] = max(0.0, r[2] - steps[q][1] * dt)
            for q in finished:
                self._finish(s, q)
        if s.done != total:
            stuck = [a.name for a in self.actors if s.remaining[a.name] > 0]
            raise ValueError(f"task graph deadlocks: {s.done}/{total} tasks ran; waiting: {stuck[:8]}")
        return s


def _timeline(s: _State, snapshots: list) -> Timeline:
    first = {}
    for name, _, start, _ in s.tasks:
        if name not in first or start < first[name]:
            first[name] = start
    tasks = sorted(s.tasks, key=lambda x: (x[2], x[3], x[0], x[1]))
    return Timeline(tasks, max((e for *_, e in s.tasks), default=0.0), s.tasks, snapshots, first)


def simulate(graph: TaskGraph, snapshot_every: int = 1) -> Timeline:
    """Full simulation of ``graph`` from an empty state."""
    sim = _Sim(graph)
    snaps: list = []
    return _timeline(sim.run(sim.initial(), snaps, snapshot_every), snaps)


def resimulate(old: Timeline, graph: TaskGraph, changed, snapshot_every: int = 1) -> Timeline:
    """Delta simulation: ``graph`` equals the graph of ``old`` except the works of actors in ``changed``.

    Restarts from the last snapshot taken before the first start of a changed
    actor; identical to ``simulate(graph)``.
    """
    changed = set(changed)
    unknown = changed - {a.name for a in graph.actors}
    if unknown:
        raise ValueError(f"changed actors {sorted(unknown)} are not in the graph")
    starts = [old.first_start[n] for n in changed if n in old.first_start]
    sim = _Sim(graph)
    if not starts or not old.snapshots:
        return simulate(graph, snapshot_every)
    t_first = min(starts)
    keep = 0
    for i, (t, _) in enumerate(old.snapshots):
        if t < t_first:
            keep = i
        else:
            break
    snaps = list(old.snapshots[: keep + 1])
    state = snaps[-1][1].copy(old.raw)
    # The snapshot's running works were computed before the change: none is a changed actor (they start later).
    snaps.pop()
    return _timeline(sim.run(state, snaps, snapshot_every), snaps)
