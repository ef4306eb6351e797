"""What a pipeline schedule is made of: the activation stash's quota per stage, and nothing else.

The pipeline step (``runtime.pipeline.step``) and the search's task graph
(``toolkit.search.taskgraph``) build their forward actors with these quotas;
the config schema lists ``SCHEDULES``. Under ``1f1b`` stage ``s`` of ``pp``
holds at most ``pp - s`` micro-batches awaiting their backward; under
``gpipe`` every micro-batch of the step.
"""
from __future__ import annotations

from ..executor import RECEIVE_QUOTA

SCHEDULES = ("1f1b", "gpipe")


def stash_quota(schedule: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches stage ``stage`` may hold between their forward and their backward."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule {schedule!r} is not one of {SCHEDULES}")
    return pp - stage if schedule == "1f1b" else micro_batches


def too_few_micro_batches(micro_batches: int, pp: int) -> bool:
    """A pipeline of ``pp`` stages needs at least ``pp`` micro-batches per step (each stage one in flight)."""
    return pp > 1 and micro_batches < pp


# A boundary tensor's cut (sender's copy queue) holds one micro-batch; the transfer (the executor's
# receiver) and the assemble (receiver's copy queue) two: the next micro-batch moves while this one is used.
CUT_QUOTA, SEND_QUOTA, ASSEMBLE_QUOTA = 1, RECEIVE_QUOTA, 2


def compute_actors(schedule: str, pp: int, stage: int, micro_batches: int) -> dict:
    """Stage ``stage``'s compute actors in a training step: ``{role: (quota, priority, every)}``.

    ``F`` holds the activation stash (``stash_quota``); ``B`` outranks it, so
    a stage whose stash is full or that has a gradient waiting runs a backward
    (1F1B); ``reduce`` and ``update`` run once per step (``every`` is the
    number of pieces per run: 1 per micro-batch, ``micro_batches`` per step),
    after the last backward. The pipeline step (``runtime.pipeline.step``) and
    the search's task graph (``toolkit.search.taskgraph``) both build their
    actors from this table.
    """
    m = micro_batches
    return {"F": (stash_quota(schedule, pp, stage, m), 0, 1), "B": (2, 1, 1), "reduce": (1, 2, m), "update": (1, 3, m)}
