"""What a pipeline schedule is made of: the activation stash's quota per stage, and nothing else.

The pipeline step (``runtime.pipeline.step``) and the search's task graph
(``toolkit.search.taskgraph``) build their forward actors with these quotas;
the config schema lists ``SCHEDULES``. Under ``1f1b`` stage ``s`` of ``pp``
holds at most ``pp - s`` micro-batches awaiting their backward; under
``gpipe`` every micro-batch of the step.
"""
from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")


def stash_quota(schedule: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches stage ``stage`` may hold between their forward and their backward."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule {schedule!r} is not one of {SCHEDULES}")
    return pp - stage if schedule == "1f1b" else micro_batches


def too_few_micro_batches(micro_batches: int, pp: int) -> bool:
    """A pipeline of ``pp`` stages needs at least ``pp`` micro-batches per step (each stage one in flight)."""
    return pp > 1 and micro_batches < pp
