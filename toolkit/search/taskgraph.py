"""The task graph of one pipelined training step, actor for actor as ``runtime.pipeline.step`` builds it.

Per stage ``s`` (one representative rank: the ranks of a stage act in
lockstep) on its compute queue: ``s{s}.F`` (forward of a micro-batch; its
out register is the activation stash, its quota the runtime's own,
``runtime.pipeline.schedule.stash_quota``), ``s{s}.B`` (backward, priority 1, reads the stash and the
gradient from stage ``s + 1``), ``s{s}.reduce`` (once per step, priority 2)
and ``s{s}.update`` (once per step, priority 3). Between stages, as the
runtime's boundary actors: a *cut* on the sender's copy queue, the
*send* on a channel of its own (quota 2, the receiver's registers) and an
*assemble* on the receiver's copy queue (quota 2) — for activations
forward and gradients backward. Tied parameters (the first and last
stage's copies) exchange their gradients after both reductions; clipping by
the global norm makes every update wait for every stage's reduction.

Compute tasks, communication tasks, micro-batches and stages are all
here; nothing orders forwards and backwards but quotas and priorities, as in
training.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.pipeline.schedule import ASSEMBLE_QUOTA, CUT_QUOTA, SEND_QUOTA, compute_actors, too_few_micro_batches

from .simulator import SimActor, TaskGraph


@dataclass(frozen=True)
class StageWork:
    """Seconds of work of one stage's actors (per micro-batch, or per step for reduce and update).

    ``send``/``copy``: moving one micro-batch's boundary activation (or its
    gradient) to the next stage, and cutting/assembling it on each side.
    ``weight``: threads the stage keeps busy while it works (shared cores),
    0 on devices with processors of their own.
    """

    forward: float
    backward_first: float
    backward: float
    reduce: float
    update: float
    send: float = 0.0
    copy: float = 0.0
    weight: float = 0.0


def stage_actor_names(stage: int, pp: int) -> list:
    """The actors whose work comes from stage ``stage``'s ``StageWork``."""
    names = [f"s{stage}.{k}" for k in ("F", "B", "reduce", "update")]
    if stage < pp - 1:
        names += [f"s{stage}.act.{k}" for k in ("cut", "send", "assemble")]
    if stage > 0:
        names += [f"s{stage}.grad.{k}" for k in ("cut", "send", "assemble")]
    return names


def _transfer(name: str, producer: str, src: int, dst: int, w: StageWork, to: StageWork) -> list:
    """A boundary tensor from stage ``src`` to ``dst``: cut on the sender's copy queue, sent on their link,
    assembled on the receiver's copy queue (the runtime's boundary actors, ``runtime.pipeline.boundary``)."""
    return [SimActor(f"{name}.cut", f"s{src}.copy", w.copy, (producer,), quota=CUT_QUOTA, weight=w.weight),
            SimActor(f"{name}.send", f"link.s{src}>s{dst}", w.send, (f"{name}.cut",), quota=SEND_QUOTA,
                     weight=w.weight),
            SimActor(f"{name}.assemble", f"s{dst}.copy", to.copy, (f"{name}.send",), quota=ASSEMBLE_QUOTA,
                     weight=to.weight)]


def pipeline_graph(stages: list, micro_batches: int, schedule: str = "1f1b", tied: float | None = None,
                   clip: bool = False, rate=None) -> TaskGraph:
    """One training step of ``len(stages)`` stages over ``micro_batches`` micro-batches.

    ``tied``: seconds of the tied-gradient exchange between the first and last
    stage (``None``: no tied parameters); ``clip``: global-norm clipping;
    ``rate``: speed per busy thread on a machine whose cores the stages share
    (``Cluster.thread_rate``; ``None``: every device has its own processor).
    """
    pp, m = len(stages), micro_batches
    if pp < 1:
        raise ValueError("a pipeline needs at least one stage")
    if not isinstance(m, int) or m < 1 or too_few_micro_batches(m, pp):
        raise ValueError(f"{m} micro-batches for {pp} stages: a pipeline needs at least as many micro-batches as stages")
    actors = []
    for s, w in enumerate(stages):
        comp = f"s{s}.compute"
        f_in = () if s == 0 else (f"s{s - 1}.act.assemble",)
        b_in = (f"s{s}.F",) if s == pp - 1 else (f"s{s}.F", f"s{s + 1}.grad.assemble")
        table = compute_actors(schedule, pp, s, m)  # the runtime's quotas, priorities and rates
        work = {"F": w.forward, "B": [w.backward_first] + [w.backward] * (m - 1), "reduce": w.reduce}
        inputs = {"F": f_in, "B": b_in, "reduce": (f"s{s}.B",)}
        actors += [SimActor(f"s{s}.{role}", comp, work[role], inputs[role], quota=table[role][0],
                            priority=table[role][1], every=table[role][2], weight=w.weight) for role in work]
        if s < pp - 1:  # activations to the next stage, gradients back to the one before
            actors += _transfer(f"s{s}.act", f"s{s}.F", s, s + 1, w, stages[s + 1])
        if s > 0:
            actors += _transfer(f"s{s}.grad", f"s{s}.B", s, s - 1, w, stages[s - 1])
    if tied is not None and pp > 1:
        actors.append(SimActor("tied", "link.tied", tied, ("s0.reduce", f"s{pp - 1}.reduce"), quota=1, every=m))
    for s, w in enumerate(stages):
        u_in = [f"s{s}.reduce"]
        if tied is not None and pp > 1 and s in (0, pp - 1):
            u_in.append("tied")
        if clip and pp > 1:
            u_in += [f"s{j}.reduce" for j in range(pp) if j != s]
        quota, priority, every = compute_actors(schedule, pp, s, m)["update"]
        actors.append(SimActor(f"s{s}.update", f"s{s}.compute", w.update, tuple(u_in), quota=quota,
                               priority=priority, every=every, weight=w.weight))
    return TaskGraph(actors, m, rate=rate)
