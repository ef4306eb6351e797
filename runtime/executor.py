"""Running a plan: one OS thread per hardware queue, each a FIFO of messages.

On a host without an accelerator, "data" and "copy" actors that exchange
nothing with other ranks run on the compute thread, and one between compute
and a single channel's send (a pipeline boundary's cut) on that
channel's thread (``thread_homes``): there the only hardware is the CPU, and
each extra Python thread a value crosses only contends with the step for
the GIL.

The threads outlive a run: each queue's loop runs on a long-lived worker of
that queue (``runtime.workers``; a thread started per step costs its cold
allocator and BLAS state every step). A run whose actors all land on one
thread (one device and its data pipeline on a host without an accelerator)
runs that loop on the caller's thread instead: there is nothing for a second
thread to overlap, and the step then runs where a plain training loop would
(see ``_execute``). Such a run is recorded the first time and replayed after
(``runtime.replay``), unless traced.

Each queue thread owns the actors placed on it and touches only them. It
drains its messages (``req``: a register became readable; ``ack``: a
consumer is done with one), then lets the highest-priority ready actor act
once, and repeats; with nothing ready it blocks on its inbox. Messages
between actors of one thread go through a local deque and skip the inbox.
There is no scheduler besides these state machines. In a lockstep gang
(the ranks of one pipeline stage, whose actions call collectives with each
other) the gang's first rank picks as above and its compute thread
broadcasts each pick; the others act in that order.

An exception in any action stops every thread and re-raises in the caller
naming the actor and piece; if no actor can act for ``timeout`` seconds the
run stops with an error listing what each waiting actor lacks (at once when
the run's only thread, the caller's, finds none ready and no message).
"""
from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from sbp_core.boxing import collectives
from sbp_core.process_groups import channel_group, world_device, world_rank, world_size

from . import workers
from .actor import Actor, Pool
from .ids import actor_id, thread_of
from .plan import QUEUES, ActorSpec, Plan, PlanError
from .replay import Schedule

# A cross-rank edge's receiver holds two registers: the next piece travels while the consumer uses this one.
RECEIVE_QUOTA = 2


# An idle queue thread blocks on its inbox: messages, and the ``None`` that stops a run, wake it, so
# the timeout is only a backstop. Each wake-up of a Python thread takes the GIL from the compute
# thread and costs ~0.1 ms of CPU on a 2-core VM: two idle threads polling every 0.05 s and the caller
# every 0.1 s used 11.3 ms of CPU per 2 s of a sleeping step; blocking as below, 2.9 ms.
_IDLE_WAIT = 1.0
# How often the caller checks for errors and stalls (the run's ``timeout`` is counted in these).
_CHECK_EVERY = 0.5


class RuntimeFailure(RuntimeError):
    """An action raised, or the run stopped making progress."""


@dataclass
class ActorStats:
    actions: int
    max_live: int
    quota: int


@dataclass
class RunResult:
    stats: dict  # actor (or pool) name -> ActorStats
    outputs: dict  # sink actor name -> its outputs in piece order


class QueueThread:
    """One queue's loop for one run, on a long-lived worker thread of that queue (``runtime.workers``)."""

    def __init__(self, index: int, name: str, run):
        self.index = index
        self.queue_name = name
        self.run_state = run
        self.inbox = queue.SimpleQueue()
        self.local: deque = deque()
        self.actors: list = []  # by priority, highest first, ties in plan order (sorted by _execute)
        self.busy = False  # an action is under way (a long action is not a stall)
        self.acting = None  # the actor whose action is under way (a network one may be blocked on its peer)
        self.gang = None  # (group, leader rank, roles in sorted order) on a ganged compute queue
        self.alone = False  # the run's only thread: no message can come from elsewhere
        self._done = None  # set when the loop has returned

    def start(self) -> None:
        self._done = workers.start(self.queue_name, self.run)

    def is_alive(self) -> bool:
        return self._done is not None and not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        if self._done is not None:
            self._done.wait(timeout)

    def send(self, kind, reg, actor, edge):
        target = self.run_state.threads[thread_of(actor.aid)]
        msg = (kind, reg, actor, edge)
        if target is self:
            self.local.append(msg)
        else:
            target.inbox.put(msg)

    def _handle(self, msg) -> None:
        kind, reg, actor, edge = msg
        if kind == "req":
            if actor.on_req(reg, edge):
                self.send("ack", reg, reg.owner, None)
        else:
            actor.on_ack(reg)

    def _drain(self) -> None:
        local, inbox = self.local, self.inbox
        while local:
            self._handle(local.popleft())
        while not inbox.empty():  # this thread alone takes from its inbox: not empty stays so
            msg = inbox.get_nowait()
            if msg is None:
                return
            self._handle(msg)

    def _pick(self):
        if self.gang is not None:
            return self._pick_in_gang()
        return self._pick_ready()

    def _pick_in_gang(self):
        """The leader's pick, the same on every rank of the gang (the leader broadcasts it)."""
        group, leader, roles = self.gang
        me = world_rank()
        if me == leader:
            actor = self._pick_ready()
            if actor is None:
                return None
            collectives.broadcast_ints([roles.index(actor.spec.key)], leader, group)
            return actor
        if all(a.remaining == 0 for a in self.actors):
            return None
        (k,) = collectives.broadcast_ints([0], leader, group)
        actor = next(a for a in self.actors if a.spec.key == roles[k])
        while not actor.ready():  # the leader saw its inputs already; ours are on the way
            if self.run_state.stopping:
                return None
            try:
                msg = self.inbox.get(timeout=_IDLE_WAIT)
            except queue.Empty:
                continue
            if msg is None:
                return None
            self._handle(msg)
            self._drain()
        return actor

    def _pick_ready(self):
        for a in self.actors:  # the first ready one: the highest priority, ties in plan order
            if a.ready():
                return a
        return None

    def run(self) -> None:
        st = self.run_state
        trace, send = st.trace, self.send
        actor = None
        works = not self.queue_name.startswith("network")  # a network thread blocks on its peer: waiting, not work
        try:
            while not st.stopping:
                self._drain()
                actor = self._pick()
                if actor is not None:
                    self.busy, self.acting = works, actor
                    if trace is None:
                        out = actor.act(send)
                    else:
                        start, piece = time.perf_counter(), actor.next_piece
                        out = actor.act(send)
                        trace.record(actor.spec.name, self.index, start, time.perf_counter(), piece)
                    self.busy, self.acting = False, None
                    sink = st.outputs.get(actor.spec.name)
                    if sink is not None:
                        sink.append(out)
                    st.progress += 1
                    continue
                actor = None
                if all(a.remaining == 0 for a in self.actors):
                    return
                if self.alone and not self.local and self.inbox.empty():  # nothing can make an actor ready
                    st.stalled = True
                    return
                try:
                    msg = self.inbox.get(timeout=_IDLE_WAIT)
                except queue.Empty:
                    continue
                if msg is not None:
                    self._handle(msg)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
            st.fail(actor, exc)


class _Run:
    def __init__(self, trace):
        self.threads: dict = {}
        self.stopping = False
        self.error = None
        self.progress = 0
        self.stalled = False  # the run's only thread found no actor that could ever act
        self.trace = trace
        self.outputs: dict = {}

    def fail(self, actor, exc) -> None:
        if self.error is None:
            self.error = (actor, exc)
        self.stop()

    def stop(self) -> None:
        """Every queue thread returns at its next message; each gets one now."""
        self.stopping = True
        for t in self.threads.values():
            t.inbox.put(None)


def run(plan: Plan, pieces: int, timeout: float = 60.0, trace=None) -> RunResult:
    """Run every actor of ``plan`` ``pieces`` times; returns this rank's stats and sinks' outputs.

    Called on every rank with the same plan; each rank runs the actors placed
    on it. Across ranks the consumer pulls: its receive actor posts a receive
    only when it has a free register (credit), and the producer's send actor
    holds the producer's register until the transfer is done (back pressure).
    """
    me, world = world_rank(), world_size()
    prep = _prepared(plan, me, world)
    if pieces < 0:
        raise PlanError(f"pieces must be >= 0, got {pieces}")
    uneven = [name for name, every in prep.every if pieces % every]
    if uneven:
        raise PlanError(f"{pieces} pieces are not a multiple of every= of actors {uneven}")
    return _execute(prep, pieces, timeout, trace, me, plan.pools)


@dataclass
class _Prepared:
    """What ``run`` derives from a plan alone on one rank: the same for every run of that plan."""

    key: tuple  # the plan's actors, gangs and pools, and the rank and world it was prepared for
    specs: list  # this rank's actors (``_local_specs``)
    names: set  # every actor's name
    every: list  # (name, every) of every actor
    gang: tuple | None  # (group, leader) of this rank's lockstep gang
    home: dict  # ``thread_homes(specs)``
    schedules: dict = field(default_factory=dict)  # pieces -> the recorded order of a single-thread run


def _prepared(plan: Plan, me: int, world: int) -> _Prepared:
    """``plan`` validated and prepared for rank ``me``, once per plan: a step's plan runs every step, and
    validating it, finding this rank's actors and their threads cost more than the executor's loop.
    Kept on the plan while its actors (``ActorSpec`` is frozen), gangs and pools are the same objects."""
    key = (tuple(map(id, plan.actors)), tuple(map(tuple, plan.lockstep)), tuple(plan.pools.items()), me, world)
    prep = plan.__dict__.get("_prepared")
    if prep is not None and prep.key == key:
        return prep
    plan.validate(world)
    specs = _local_specs(plan, me)
    _open(plan, me)
    gangs = [(channel_group(f"gang:{tuple(g)}", g), min(g)) for g in plan.lockstep]
    gang = next(((grp, lead) for (grp, lead), g in zip(gangs, plan.lockstep) if me in g), None)
    prep = _Prepared(key, specs, {s.name for s in plan.actors}, [(a.name, a.every) for a in plan.actors], gang,
                     thread_homes(specs, gang is not None))
    plan.__dict__["_prepared"] = prep
    return prep


def _local_specs(plan: Plan, me: int) -> list:
    """This rank's actors, with a send/receive actor pair for every edge that crosses ranks.

    A receive is posted ahead of its data (``RECEIVE_QUOTA`` registers), so the next value travels while
    the consumer works; each posted receive waits at most the groups' timeout. A value made once per
    several pieces (``every > 1``: a step's loss after the last stage's ``reduce``) is received only once
    its consumer's own inputs on this rank for that action are there (``_after``): otherwise its receive
    would wait from the start of the run, and the timeout would bound the run's length.
    """
    ranks = {s.name: s.rank for s in plan.actors}
    channels = _channels(plan)
    local = [s for s in plan.actors if s.rank == me]
    # On a GPU each local producer with a consumer elsewhere marks its value's kernels (``_marking``), so
    # its sends wait for them alone, not for the compute its thread queued after them. One off the compute
    # thread (a boundary's cut) runs its kernels behind the marks of its compute inputs alone
    # (``collectives.after_marks``), which their actors take as they make them.
    device = None if host_only() else world_device()
    marks = {src: {} for src, a, _ in channels if a == me and device is not None and device.type == "cuda"}
    by_name = {s.name: s for s in local}
    upstream = {i: {} for s in local if s.name in marks and s.queue != "compute"
                for i in s.inputs if i in by_name and by_name[i].queue == "compute"}
    local = [_marked(s, marks, upstream, device) for s in local]
    for c, (src, a, b) in enumerate(channels):
        group = _channel_group(src, a, b)
        queue_name = f"network:{c}"
        every, out = plan.by_name()[src].every, plan.by_name()[src].out
        if me == a:
            local.append(ActorSpec(f"send:{src}->{b}", _sender(src, b, group, out, marks.get(src)), inputs=(src,),
                                   queue=queue_name, quota=1, every=every))
        if me == b:
            recv = f"recv:{src}"
            after = () if every == 1 else tuple(dict.fromkeys(
                i for s in plan.actors if s.rank == me and src in s.inputs for i in s.inputs if ranks[i] == me))
            local.append(ActorSpec(recv, _after(_receiver(a, group, device, out)) if after else
                                   _receiver(a, group, device, out), inputs=after, queue=queue_name,
                                   quota=RECEIVE_QUOTA, every=every))
            local = [
                replace(s, inputs=tuple(recv if i == src else i for i in s.inputs),
                        initial={(recv if k == src else k): v for k, v in s.initial.items()})
                if s.rank == me and src in s.inputs else s
                for s in local
            ]
    return local


def _channels(plan: Plan) -> list:
    """``(producer, producer rank, consumer rank)`` of every edge that crosses ranks, the same order on every rank."""
    ranks = {s.name: s.rank for s in plan.actors}
    channels = []
    for s in plan.actors:
        for src in s.inputs:
            ch = (src, ranks[src], s.rank)
            if ranks[src] != s.rank and ch not in channels:
                channels.append(ch)
    return channels


def _channel_group(src: str, a: int, b: int):
    return channel_group(f"{src}:{a}->{b}", (a, b))


def _open(plan: Plan, me: int) -> None:
    """One element over each of this rank's channels, in the plan's channel order (every rank's), before
    any actor runs (``collectives.open_p2p``).

    Under NCCL a channel's communicator is built by its first transfer; here
    every channel's is, between runs, from the caller's thread and in one
    order on every rank, not on the channel's thread while the compute
    thread issues a run's collectives. Blocking, it cannot wait on itself:
    the earliest channel not yet opened has both its ranks at it.
    """
    for src, a, b in _channels(plan):
        if me in (a, b):
            collectives.open_p2p(b if me == a else a, _channel_group(src, a, b), send=me == a)


def _after(receive):
    """``receive(piece)`` as an action that also reads (and ignores) the local inputs it waits for."""
    def act(piece, *_):
        return receive(piece)

    return act


def _marked(spec: ActorSpec, marks: dict, upstream: dict, device) -> ActorSpec:
    """``spec``, marking its values for its sends (``marks``) and for the actors off the compute thread that
    read them (``upstream``); one of those runs behind its inputs' marks (``_marking_after``)."""
    kept = [m[spec.name] for m in (marks, upstream) if spec.name in m]
    if not kept:
        return spec
    if spec.queue != "compute" and spec.name in marks:
        ups = [upstream.get(i) for i in spec.inputs]
        return replace(spec, action=_marking_after(spec.action, marks[spec.name], ups, device))
    return replace(spec, action=_marking(spec.action, kept, device))


def _marking(action, kept: list, device):
    """``action``, then a ``collectives.ready_mark`` of what it queued, kept in each dict of ``kept`` under its
    piece for the sends of its value and the actors that read it (a producer and each of its readers count
    the same pieces in order)."""

    def act(piece, *values):
        out = action(piece, *values)
        mark = collectives.ready_mark(device)
        for marks in kept:
            marks[piece] = mark
        return out

    return act


def _marking_after(action, marks: dict, upstream: list, device):
    """``action`` with its kernels behind its inputs' marks alone (``upstream``: each input's marks by piece,
    or ``None`` for an input its actor does not mark), then the mark of its value in ``marks``."""

    def act(piece, *values):
        with collectives.after_marks(device, [None if u is None else u.get(piece) for u in upstream]):
            out = action(piece, *values)
            marks[piece] = collectives.ready_mark(device)
        return out

    return act


def _sender(producer: str, dst: int, group, out, marks=None):
    """The send action of a channel: the data alone when the producer declares its ``out``, else a header
    first; ``marks``: the producer's ``_marking`` (its value's ready mark per piece), or ``None``."""
    if out is None:
        def send(piece, value):
            collectives.send_object(value, dst, group, None if marks is None else marks.get(piece))

        return send
    shape, dtype = torch.Size(out[0]), out[1]

    def send_data(piece, value):
        if not (isinstance(value, torch.Tensor) and value.shape == shape and value.dtype == dtype
                and value.is_contiguous()):
            got = (f"{tuple(value.shape)} {value.dtype}{'' if value.is_contiguous() else ' not contiguous'}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise TypeError(f"actor {producer!r} declares out {tuple(shape)} {dtype} but produced {got}")
        collectives.send_tensor(value.detach(), dst, group, None if marks is None else marks.get(piece))

    return send_data


def _receiver(src: int, group, device, out):
    if out is None:
        def recv(piece):
            return collectives.recv_object(src, group, device)

        return recv
    shape, dtype = torch.Size(out[0]), out[1]

    def recv_data(piece):
        return collectives.recv_tensor(shape, dtype, src, group, device)

    return recv_data


def _queue_order(q: str) -> tuple:
    return (QUEUES.index(q), q) if q in QUEUES else (len(QUEUES), q)


def host_only() -> bool:
    """Whether this process computes on the host CPU alone (no accelerator for the compute queue to drive):
    its job is not NCCL's, whatever devices the machine has."""
    return world_device().type == "cpu"


def thread_homes(specs, ganged: bool) -> dict:
    """``{actor name: the queue whose thread runs it}`` for one rank's actors (``_local_specs``).

    Every queue has a thread of its own, except on a host without an
    accelerator (``host_only()``): there the compute thread's work is the
    host's work, so another Python thread adds no device to overlap with; it
    only takes the GIL from the step at each of its torch calls and wake-ups.
    So a "data" or "copy" actor runs on the compute thread when every actor
    it reads from or feeds is a compute actor or moves too. One that touches
    a network actor (directly or through such a chain) keeps its thread: a
    compute action may block in a collective, and a transfer to or from
    another rank must not wait behind it (that rank may need the transfer to
    reach the collective). A ganged compute thread (``lockstep``) broadcasts
    every pick to its gang, so nothing moves onto it. A "data" or "copy"
    actor left with one register, read by one channel's send alone, that
    reads compute actors (a pipeline boundary's cut) runs on that channel's
    thread: the value then crosses one thread fewer on its way, each
    crossing a wake-up and a GIL hand-off, and the cut cannot act while the
    send holds its one register anyway. An actor that reads a receive keeps
    its thread: the receive of the next piece, posted as soon as a register
    is free, blocks its thread until the peer sends, and the peer may be
    waiting for what that actor feeds, whose releases of the actor's
    registers would queue behind the receive.

    Measured on a 2-core VM (tiny GPT-2, 16 x 32 tokens, 60 steps, the
    ``scripts/bench_dataloader.py`` setting): the loop took 1180 ms with the
    four data actors on a data thread against 1105 ms on the compute thread
    (means of 8 runs), and on the data thread ``decode`` took 34 ms of wall
    time for 11 ms of CPU, waiting for the GIL.
    """
    home = {s.name: s.queue for s in specs}
    if not host_only() or "compute" not in home.values():
        return home
    neighbours = {s.name: list(s.inputs) for s in specs}
    for s in specs:
        for src in s.inputs:
            neighbours[src].append(s.name)
    moving = {n for n, q in home.items() if q in ("data", "copy")} if not ganged else set()
    while True:
        stays = {n for n in moving if any(home[m] != "compute" and m not in moving for m in neighbours[n])}
        if not stays:
            break
        moving -= stays
    for n in moving:
        home[n] = "compute"
    settled = dict(home)  # a channel's own actors only: no chain of data/copy actors folds onto it
    feeds = {s.name: [] for s in specs}
    for s in specs:
        for src in s.inputs:
            feeds[src].append(s.name)
    for s in specs:  # a cut: one register, read by one send alone, made from compute actors' values
        out = feeds[s.name]
        if (settled[s.name] in ("data", "copy") and s.quota == 1 and len(out) == 1
                and settled[out[0]].startswith("network") and all(settled[i] == "compute" for i in s.inputs)):
            home[s.name] = settled[out[0]]
    return home


def _execute(prep: _Prepared, pieces, timeout, trace, rank, pools) -> RunResult:
    specs, user_names, gang, home = prep.specs, prep.names, prep.gang, prep.home
    used = sorted(set(home.values()), key=_queue_order)
    # One thread, no gang, no network: the order is the plan's alone, recorded once (``runtime.replay``).
    alone = len(used) == 1 and gang is None and not used[0].startswith("network")
    record = alone and trace is None
    if record and pieces in prep.schedules:
        return _replay(prep.schedules[pieces], rank)
    st = _Run(trace)
    for i, q in enumerate(used):
        st.threads[i] = QueueThread(i, q, st)
        if trace is not None:  # a thread named by the queues whose actors it runs
            trace.threads[i] = "+".join(sorted({s.queue for s in specs if home[s.name] == q}, key=_queue_order))
    if gang is not None and "compute" in used:
        compute = st.threads[used.index("compute")]
        compute.gang = (gang[0], gang[1], sorted(a.key for a in specs if a.queue == "compute"))
    every = {s.name: s.every for s in specs}
    actors = {}
    pool = {name: Pool(name, size) for name, size in (pools or {}).items() if any(s.pool == name for s in specs)}
    for k, spec in enumerate(specs):
        t = st.threads[used.index(home[spec.name])]
        need = [spec.every // every[src] for src in spec.inputs]
        a = Actor(actor_id(rank, t.index, k), spec, pieces, need, pool.get(spec.pool))
        t.actors.append(a)
        actors[spec.name] = a
    for t in st.threads.values():
        t.actors.sort(key=lambda a: -a.spec.priority)  # stable: ties keep plan order
    for spec in specs:
        for edge, src in enumerate(spec.inputs):
            actors[src].consumers.append((actors[spec.name], edge))
    prefill, filled = [], {}  # (key, consumer spec or None, producer) per pre-filled register; producer -> count
    for spec in specs:
        for edge, src in enumerate(spec.inputs):
            producer = actors[src]
            if src in spec.initial:  # (Plan.validate: the producer's quota covers every pre-filled register)
                n = filled[src] = filled.get(src, 0) + 1
                reg = producer.free.pop()
                reg.value, reg.piece, reg.pending = spec.initial[src], -n, 1  # each its own piece before the first
                prefill.append(((producer.aid, -n), spec, src))
                actors[spec.name].on_req(reg, edge)
            for _ in range(spec.credits.get(src, 0)):  # n registers of None ahead of the producer's first
                n = filled[src] = filled.get(src, 0) + 1
                reg = producer.free.pop()
                reg.value, reg.piece, reg.pending = None, -n, 1
                prefill.append(((producer.aid, -n), None, None))
                actors[spec.name].on_req(reg, edge)
    for a in actors.values():
        a.max_live = a.live
        if not a.consumers and a.spec.name in user_names:
            st.outputs[a.spec.name] = []
    log = [] if record else None
    for a in actors.values():
        a.log = log
    if alone:
        _run_on_caller(st.threads[0])
    else:
        _run_on_workers(st, actors, timeout)
    if st.stalled:
        raise RuntimeFailure("no actor can act, and this run's only thread waits for nothing else; waiting: "
                             + "; ".join(_why(a) for a in actors.values() if a.remaining))
    if st.error is not None:
        actor, exc = st.error
        if isinstance(exc, KeyboardInterrupt):
            raise exc
        where = f"actor {actor.spec.name!r} failed on piece {actor.next_piece}" if actor else "a queue thread failed"
        raise RuntimeFailure(f"rank {rank}: {where}: {type(exc).__name__}: {exc}") from exc
    stats = {n: ActorStats(a.actions, a.max_live, a.spec.quota) for n, a in actors.items()}
    stats.update({n: ActorStats(0, p.max_live, p.size) for n, p in pool.items()})
    if record:
        sinks = {a.aid: name for name, a in actors.items() if name in st.outputs}
        prep.schedules[pieces] = Schedule.record(log, {a.aid: a for a in actors.values()}, prefill, sinks, stats)
    return RunResult(stats, st.outputs)


def _replay(schedule: Schedule, rank: int) -> RunResult:
    """A single-thread run in its recorded order (``runtime.replay``), on the caller's thread with autograd on."""
    outputs = {name: [] for name in schedule.sinks.values()}
    failed = []
    with torch.enable_grad():
        if schedule.replay(outputs, lambda spec, piece, exc: failed.append((spec, piece, exc))):
            return RunResult(dict(schedule.stats), outputs)
    spec, piece, exc = failed[0]
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    raise RuntimeFailure(f"rank {rank}: actor {spec.name!r} failed on piece {piece}: {type(exc).__name__}: {exc}") \
        from exc


def _run_on_caller(thread: QueueThread) -> None:
    """The run's only queue loop, on the calling thread, with autograd on as on a worker (restored after).

    Nothing runs beside it, so the caller has nothing to watch: an action's
    exception ends the loop (``st.error``), and a loop with no ready actor
    and no message ends it at once (``st.stalled``), since no other thread
    could send one. (A network thread, whose waits on a peer the caller must
    bound by the run's timeout, and a ganged compute thread, whose picks wait
    on the gang, stay on workers.)

    The step then runs on the thread a plain loop runs on. On a 2-core VM,
    the tiny GPT-2 step of ``scripts/bench_dataloader.py`` read 0.94x, 1.01x
    and 1.02x on a long-lived worker against the main thread in three
    processes (16 paired repeats each), a per-process difference that
    pinning the process to one core removed (0.99-1.01x).
    """
    thread.alone = True
    with torch.enable_grad():
        thread.run()


def _run_on_workers(st: _Run, actors: dict, timeout: float) -> None:
    """Every queue loop on a long-lived worker; the caller waits, failing the run on an error or a stall."""
    for t in st.threads.values():
        t.start()
    last, since = -1, time.monotonic()
    pending = list(st.threads.values())
    while pending:
        # Wake when the first pending thread ends, else every _CHECK_EVERY s for the error and stall checks:
        # the caller's thread costs CPU per wake-up, which the queue threads' work competes with.
        pending[0].join(_CHECK_EVERY)
        pending = [t for t in pending if t.is_alive()]
        if st.error is not None:
            break
        if st.progress != last or any(t.busy for t in st.threads.values()):
            last, since = st.progress, time.monotonic()
        elif time.monotonic() - since > timeout:
            st.stop()
            acting = {t.acting for t in st.threads.values()}
            waiting = [_why(a, a in acting) for a in actors.values() if a.remaining]
            raise RuntimeFailure(f"no actor could act for {timeout:g} s; waiting: " + "; ".join(waiting))
    if st.error is None:
        for t in st.threads.values():
            t.join()


def _why(a: Actor, acting: bool = False) -> str:
    """What actor ``a`` waits for; ``acting``: its action is under way (e.g. a receive waiting for its peer)."""
    if acting:
        return f"{a.spec.name} (piece {a.next_piece}) is in its action"
    lacks = [a.spec.inputs[k] for k, q in enumerate(a.inputs) if not q]
    need = []
    if lacks:
        need.append(f"input from {lacks}")
    if not a.free:
        need.append("a free out register")
    elif a.pool is not None and a.pool.free <= a.spec.reserve:
        need.append(f"more than {a.spec.reserve} free slots of pool {a.pool.name!r}")
    return f"{a.spec.name} (piece {a.next_piece}) needs {' and '.join(need) or 'its thread'}"
