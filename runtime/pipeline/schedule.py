"""What a pipeline schedule is made of: where the model's chunks are placed, and quotas and priorities.

A model split into ``V = v * pp`` chunks (stages, in model order) runs on
``pp`` pipeline ranks, ``v`` chunks each. A schedule is three facts, and
no list of operations:

- **placement** (``chunk_ranks``): chunk ``c`` on pipeline rank ``c mod pp``
  (round robin, as Megatron's virtual stages), or in a V for ``zbv``
  (chunk ``c`` on rank ``c`` going down, ``2 pp - 1 - c`` coming back, so the
  first and last chunk share rank 0);
- **the rank's activation budget** (``stash_budget``): how many
  micro-batches (of any of its chunks) a rank may hold between a forward and
  the end of its backward — a pool shared by the rank's forward actors
  (``runtime.actor.Pool``);
- **priorities** (``compute_actors``): which ready action a rank's compute
  thread takes first.

From those, with the executor taking the highest-priority ready actor:

- ``1f1b``: budget ``pp - r`` with one chunk per rank (1F1B); with ``v``,
  ``(v-1) pp + 2 (pp-1-r) + 1``, the forwards that fit before the first
  gradient can come back, Megatron's warm-up count plus one (interleaved
  1F1B, bubble ``(pp-1)/(v m)`` of the ideal step);
- ``gpipe``, ``looped_bfs``: every micro-batch of every chunk (``v m``),
  the shallowest chunk's forwards first (GPipe; looped BFS: all forwards of
  a chunk before the next chunk's);
- ``zb``: ``v pp``, each micro-batch held until its weight pass; the
  backward split into ``B`` (input gradient) and ``W`` (weights), ``W``
  last. With one chunk per rank, ZB-H1: weight passes fill the bubbles,
  the most micro-batches held 1F1B's, its first stage's ``pp``. With
  ``v``, interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``,
  whose warm-up forwards and deferred weight passes hold ``v pp`` too);
- ``zbv``: the V placement, ``v = 2``, ``2 pp`` held until ``W`` (ZB-V: 1F1B's
  first-stage memory on every rank, as each chunk is half a stage).

Within a rank, a backward outranks a forward (1F1B); with several chunks
per rank (interleaved 1F1B) the deepest chunk's backward comes first (its
gradient is on the way back to the other ranks, and frees memory), then
the forwards, shallower first (they feed the pipeline), then the other
chunks' backwards, deeper first. Under ``zb``/``zbv`` a
backward outranks every forward, every forward every weight pass, deeper
first within each. ``reduce`` and ``update`` (once per step) come after
every backward.

One more quota shapes interleaved 1F1B and interleaved zero bubble: a
shallower chunk's forward of micro-batch ``k`` waits for the forward of
``k - pp`` of the rank's deepest chunk (``forward_credits``,
``credit_stage``: an edge holding ``pp`` credits, through a ``T`` actor that
turns each deepest forward into a credit). Without it a rank runs a shallow
chunk's forward that is ready while the deeper chunk's input is still on
its way, and the deeper chunk, on the critical path, waits for it: in the
simulator, on equal work per chunk over pp 2-8, m = pp..4pp and backward
1-3x the forward, two chunks per rank took a median 2.8% (worst 15.5%)
longer than Megatron's order without the credits, and a median 0.0% (worst
6.4%) with them. Interleaved zero bubble on the same grid, against
interleaved 1F1B's step: a median 0.949 (worst 1.139) without the credits,
0.937 (worst 1.059) with them. With three or four chunks per rank the
credits come from the deepest chunk, not the next deeper one: chained, the
first chunk could run ``(v - 1) pp`` micro-batches ahead of the deepest and
fill the budget with work far from the loss — on the same grid a median 8%
(worst 30%) over Megatron's order at v = 3 and 21% (43%) at v = 4; from
the deepest, 4% (9%) and 6% (9%).

With three or more chunks per rank, two more choices close the rest
(same grid, credits from the deepest chunk): a shallower chunk leaves one
slot of the budget for the deepest (``stash_reserve``; one per deeper
chunk held the first chunk's forward back where Megatron's order runs
it), and only the deepest chunk's backward outranks the forwards (all
backwards but the first chunk's above them ran the middle chunks'
backwards where Megatron's order runs a forward). With both, a median
0.0% behind Megatron's order (worst 4.0% at v = 3, 1.5% at v = 4; with one
chunk 7% or 30% heavier, first or last, 2.1% and 1.0%); the one slot
alone 2.8% (8.6%) and 3.0% (8.0%); the order alone 0.0%, but 15.5% and
19.7% at pp 8, m = 16. Two chunks per rank keep the same order and reserve.

The interleaved priorities matter where chunks' works differ (an embedding
or a head makes a chunk heavier): with deeper-chunk-first priorities and a
backward over the forward of its chunk, a rank ran a ready backward of its
first chunk while the deeper chunk's next input was a moment away, and the
other ranks waited for it. On 24 random two-chunk pipelines (pp 2 and 4,
m = 2pp and 4pp, chunk works within 5-20% of each other) that took a
median 11% (worst 22%) longer than Megatron's fixed order; the order above
a median 2.5% (worst 10%); with the first chunk 7% heavier (pp2, m8), 15%
and 0.4% (``tests/toolkit/test_search_schedules.py``).

The pipeline step (``runtime.pipeline.step``) and the search's task graph
(``toolkit.search.taskgraph``) build their actors from these functions;
the config schema lists ``SCHEDULES``.
"""
from __future__ import annotations

from ..executor import RECEIVE_QUOTA

SCHEDULES = ("1f1b", "gpipe", "looped_bfs", "zb", "zbv")
SPLIT_BACKWARD = ("zb", "zbv")  # the backward is two actors: B (input gradient) and W (weights)


def check_schedule(schedule: str, pp: int, v: int) -> None:
    """Refuse a schedule that cannot place ``v`` chunks on each of ``pp`` ranks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule {schedule!r} is not one of {SCHEDULES}")
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"pp_virtual={v!r} must be an int >= 1 (model chunks per pipeline rank)")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"pp_schedule=zbv places two chunks per rank in a V: it needs pp_virtual=2, got {v}")


def chunk_ranks(schedule: str, pp: int, v: int) -> list:
    """The pipeline rank (0..pp-1) of each of the ``v * pp`` chunks, in model order."""
    check_schedule(schedule, pp, v)
    if schedule == "zbv":
        return list(range(pp)) + list(reversed(range(pp)))
    return [c % pp for c in range(v * pp)]


def stash_budget(schedule: str, pp: int, v: int, rank: int, micro_batches: int) -> int:
    """Micro-batch chunks pipeline rank ``rank`` may hold between a forward and the end of its backward."""
    check_schedule(schedule, pp, v)
    m = micro_batches
    if schedule in ("gpipe", "looped_bfs"):
        budget = v * m
    elif schedule == "1f1b":
        budget = pp - rank if v == 1 else (v - 1) * pp + 2 * (pp - 1 - rank) + 1
    elif schedule == "zb":
        budget = v * pp
    else:  # zbv: a V of 2 pp chunks, each half a 1F1B stage: 1F1B's first-stage memory on every rank
        budget = 2 * pp
    return max(1, min(budget, v * m))


def too_few_micro_batches(micro_batches: int, pp: int) -> bool:
    """A pipeline of ``pp`` ranks needs at least ``pp`` micro-batches per step (each rank one in flight)."""
    return pp > 1 and micro_batches < pp


# A boundary tensor's cut (sender's copy queue) holds one micro-batch; the transfer (the executor's
# receiver) and the assemble (receiver's copy queue) two: the next micro-batch moves while this one is used.
CUT_QUOTA, SEND_QUOTA, ASSEMBLE_QUOTA = 1, RECEIVE_QUOTA, 2


def stash_reserve(pp: int, v: int, stage: int) -> int:
    """Slots of its rank's budget chunk ``stage``'s forward leaves free: one, for the rank's deepest chunk.

    So the rank's deepest chunk, nearest the loss, always finds a slot, and
    its backwards free slots for the rest (without it, a rank could fill its
    budget with its first chunk's micro-batches while its last chunk's
    forward, whose backward frees them, waits). Backwards and weight passes
    need no slot, so only micro-batches whose forward is unfinished can
    hold the budget up. One slot is enough: under interleaved 1F1B and
    interleaved zero bubble (``forward_credits``) a rank's micro-batches
    past its first chunk but not its deepest are at most ``pp``, holding at
    most ``(v - 1) pp`` slots, less than either budget; when they hold that
    many, each waits for the deepest chunk's forward alone. GPipe and looped
    BFS budget every micro-batch (``v m``); ZB-V has two chunks per rank, no
    middle one. A schedule with a pool, more than two chunks per rank, no
    credits and a budget under ``v m`` would need more. One slot per deeper
    chunk (``v - 1 - j`` for the ``j``-th) held the first chunk back where
    Megatron's order runs its next forward (see the module docstring).
    """
    return 1 if stage // pp < v - 1 else 0


def forward_credits(schedule: str, pp: int, v: int, stage: int) -> int:
    """How many micro-batches stage ``stage``'s forward may run ahead of the forward of ``credit_stage``
    (the deepest stage on its rank): ``pp`` under interleaved 1F1B and interleaved zero bubble, Megatron's
    rounds of ``pp`` micro-batches per chunk; 0 (no such edge) otherwise."""
    return pp if schedule in ("1f1b", "zb") and v > 1 and stage // pp < v - 1 else 0


def credit_stage(pp: int, v: int, stage: int) -> int:
    """The stage whose forwards grant stage ``stage``'s forward credits: the deepest of its rank's chunks
    (round-robin placement), so every shallower chunk stays within ``pp`` micro-batches of it."""
    return stage % pp + (v - 1) * pp


def split_backward(schedule: str, chunk: int) -> bool:
    """Does chunk ``chunk`` run its backward as B then W? Under ``zb``/``zbv``, every chunk but the first
    (whose input gradient nobody waits for)."""
    return schedule in SPLIT_BACKWARD and chunk > 0


def compute_actors(schedule: str, pp: int, stage: int, micro_batches: int, v: int = 1) -> dict:
    """Chunk ``stage``'s compute actors in a training step: ``{role: (quota, priority, every)}``.

    ``F`` holds the activation stash: its registers count against its rank's
    budget (``stash_budget``; the pool of the rank's forwards, or with one
    chunk per rank the quota itself); ``B`` backward (and ``W``, the weight
    pass, under ``zb``/``zbv``: it reads F's and B's registers, so the
    stash is held until it ran); ``reduce`` and ``update`` run once per step
    (``every`` is the number of pieces per run: 1 per micro-batch,
    ``micro_batches`` per step), after every chunk's last backward — they
    are the rank's, listed with its every chunk; ``T`` (with
    ``forward_credits``) turns each forward of the rank's deepest chunk
    into a credit for this chunk's forward, at once (no work). Priorities as
    the module docstring says.
    """
    m, j = micro_batches, stage // pp  # j: the chunk's place among its rank's chunks, shallow to deep
    quota = stash_budget(schedule, pp, v, chunk_ranks(schedule, pp, v)[stage], m)
    top = 4 * v + 10  # reduce and update above every chunk's actions
    if schedule in SPLIT_BACKWARD:
        prio = {"W": j, "F": v + j, "B": 2 * v + j}
    elif schedule in ("gpipe", "looped_bfs"):
        prio = {"F": v - 1 - j, "B": v + j}  # the shallowest chunk's forwards first: breadth first
    elif v > 1:  # interleaved 1F1B: the deepest chunk's backward, forwards shallow first, other backwards deep first
        prio = {"F": 2 * v - 1 - j, "B": 3 * v if j == v - 1 else j}
    else:
        prio = {"F": 0, "B": 1}
    roles = {"F": (quota, prio["F"], 1), "B": (quota if split_backward(schedule, stage) else 2, prio["B"], 1)}
    if split_backward(schedule, stage):
        roles["W"] = (1, prio["W"], 1)
    if forward_credits(schedule, pp, v, stage):
        roles["T"] = (2 * pp, top - 1, 1)  # holds the pp credits and those not yet used
    roles.update({"reduce": (1, top, m), "update": (1, top + 1, m)})
    return roles
