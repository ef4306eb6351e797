"""The task graph of one pipelined training step, actor for actor as ``runtime.pipeline.step`` builds it.

Per stage (chunk) ``c``, on the compute queue of its pipeline rank ``r``
(one representative device: the ranks of a stage act in lockstep):
``s{c}.F`` (forward of a micro-batch; its out register is the activation
stash, counted against the rank's budget), ``s{c}.B`` (backward: reads the
stash and the gradient from chunk ``c + 1``) and, under zero-bubble
schedules, ``s{c}.W`` (the weight pass); once per step on the rank,
``s{r}.reduce`` and ``s{r}.update``. Quotas, pools and priorities are the
runtime's own (``runtime.pipeline.schedule``). Between stages, as the
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

from runtime.pipeline.schedule import (ASSEMBLE_QUOTA, CUT_QUOTA, SEND_QUOTA, chunk_ranks, compute_actors,
                                       credit_stage, forward_credits, stash_budget, stash_reserve,
                                       too_few_micro_batches)

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
    """The actors whose work comes from stage ``stage``'s ``StageWork`` (one chunk per rank, no weight pass)."""
    names = [f"s{stage}.{k}" for k in ("F", "B", "reduce", "update")]
    if stage < pp - 1:
        names += [f"s{stage}.act.{k}" for k in ("cut", "send", "assemble")]
    if stage > 0:
        names += [f"s{stage}.grad.{k}" for k in ("cut", "send", "assemble")]
    return names


def _transfer(name: str, producer: str, src: int, dst: int, w: StageWork, to: StageWork) -> list:
    """A boundary tensor from pipeline rank ``src`` to ``dst``: cut on the sender's copy queue, sent on their
    link, assembled on the receiver's copy queue (the runtime's boundary actors, ``runtime.pipeline.boundary``)."""
    return [SimActor(f"{name}.cut", f"s{src}.copy", w.copy, (producer,), quota=CUT_QUOTA, weight=w.weight),
            SimActor(f"{name}.send", f"link.s{src}>s{dst}", w.send, (f"{name}.cut",), quota=SEND_QUOTA,
                     weight=w.weight),
            SimActor(f"{name}.assemble", f"s{dst}.copy", to.copy, (f"{name}.send",), quota=ASSEMBLE_QUOTA,
                     weight=to.weight)]


def pipeline_graph(stages: list, micro_batches: int, schedule: str = "1f1b", tied: float | None = None,
                   clip: bool = False, rate=None, virtual: int = 1, weight_passes: bool = True) -> TaskGraph:
    """One training step of ``len(stages)`` chunks, ``virtual`` per pipeline rank, over ``micro_batches``.

    Chunk ``c`` runs on the rank ``chunk_ranks`` gives it, on that rank's
    compute queue ``s{rank}.compute``; a rank with several chunks shares one
    activation budget among their forwards (a pool, ``stash_budget``). Under
    ``zb``/``zbv`` a chunk's backward is ``B`` (input gradient) then ``W``
    (weight gradients), half of its backward time each (a dense layer's two
    gradients cost alike); ``weight_passes=False`` (under ZeRO, where the
    runtime's ``B`` computes both and ``W`` only frees the stash): ``B`` the
    whole backward, ``W`` nothing. ``tied``: seconds of the tied-gradient exchange
    between the first and last chunk's ranks (``None``: no tied parameters;
    nothing to exchange when one rank holds both); ``clip``: global-norm
    clipping; ``rate``: speed per busy thread on a machine whose cores the
    ranks share (``Cluster.thread_rate``; ``None``: every device has its own
    processor). Rank ``r``'s reduce and update (``s{r}.reduce``,
    ``s{r}.update``) take the sum of its chunks' works.
    """
    n, m, v = len(stages), micro_batches, virtual
    if n < 1 or n % v:
        raise ValueError(f"{n} chunks do not make {v} per pipeline rank")
    pp = n // v
    if not isinstance(m, int) or m < 1 or too_few_micro_batches(m, pp):
        raise ValueError(f"{m} micro-batches for {pp} stages: a pipeline needs at least as many micro-batches as stages")
    where = chunk_ranks(schedule, pp, v)
    mine = {r: [c for c in range(n) if where[c] == r] for r in range(pp)}
    pools = {f"r{r}.stash": stash_budget(schedule, pp, v, r, m) for r in range(pp)} if v > 1 else {}
    actors = []
    for c, w in enumerate(stages):
        r = where[c]
        comp = f"s{r}.compute"
        f_in = () if c == 0 else (f"s{c - 1}.act.assemble",)
        b_in = (f"s{c}.F",) if c == n - 1 else (f"s{c}.F", f"s{c + 1}.grad.assemble")
        table = compute_actors(schedule, pp, c, m, v)  # the runtime's quotas, priorities and rates
        backward = [w.backward_first] + [w.backward] * (m - 1)
        work = {"F": w.forward, "B": backward}
        inputs = {"F": f_in, "B": b_in}
        credits = {}
        if "T" in table:  # the forward runs at most pp micro-batches ahead of the rank's deepest stage's
            work["T"], inputs["T"] = 0.0, (f"s{credit_stage(pp, v, c)}.F",)
            inputs["F"] += (f"s{c}.T",)
            credits = {f"s{c}.T": forward_credits(schedule, pp, v, c)}
        if "W" in table:
            split = [b / 2 for b in backward] if weight_passes else backward
            work.update(B=split, W=split if weight_passes else [0.0] * m)
            inputs["W"] = (f"s{c}.F", f"s{c}.B")
        actors += [SimActor(f"s{c}.{role}", comp, work[role], inputs[role], quota=table[role][0],
                            priority=table[role][1], every=table[role][2], weight=w.weight if role != "T" else 0.0,
                            pool=f"r{r}.stash" if role == "F" and pools else "",
                            reserve=stash_reserve(pp, v, c) if role == "F" and pools else 0,
                            credits=credits if role == "F" else {}) for role in work]
        if c < n - 1:  # activations to the next chunk, gradients back to the one before
            actors += _transfer(f"s{c}.act", f"s{c}.F", r, where[c + 1], w, stages[c + 1])
        if c > 0:
            actors += _transfer(f"s{c}.grad", f"s{c}.B", r, where[c - 1], w, stages[c - 1])
    for r in range(pp):
        table = compute_actors(schedule, pp, mine[r][0], m, v)
        ends = tuple(f"s{c}.{'W' if 'W' in compute_actors(schedule, pp, c, m, v) else 'B'}" for c in mine[r])
        quota, priority, every = table["reduce"]
        actors.append(SimActor(f"s{r}.reduce", f"s{r}.compute", sum(stages[c].reduce for c in mine[r]), ends,
                               quota=quota, priority=priority, every=every, weight=stages[mine[r][0]].weight))
    first, last = where[0], where[-1]
    exchange = tied is not None and first != last
    if exchange:
        actors.append(SimActor("tied", "link.tied", tied, (f"s{first}.reduce", f"s{last}.reduce"), quota=1, every=m))
    for r in range(pp):
        u_in = [f"s{r}.reduce"]
        if exchange and r in (first, last):
            u_in.append("tied")
        if clip and pp > 1:
            u_in += [f"s{j}.reduce" for j in range(pp) if j != r]
        quota, priority, every = compute_actors(schedule, pp, mine[r][0], m, v)["update"]
        actors.append(SimActor(f"s{r}.update", f"s{r}.compute", sum(stages[c].update for c in mine[r]), tuple(u_in),
                               quota=quota, priority=priority, every=every, weight=stages[mine[r][0]].weight))
    return TaskGraph(actors, m, rate=rate, pools=pools)
