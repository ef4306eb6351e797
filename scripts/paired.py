"""Paired ratios of two timed ways that ran side by side, with a bootstrap interval.

Each repeat (a round of every way, run within seconds of each other) gives
one ratio ``base / other`` of times, i.e. ``other``'s throughput over
``base``'s; drift of the machine between repeats cancels in it. The median
over repeats, and its 90% bootstrap interval (repeats resampled with
replacement), say how well a run resolves a bar: a bar inside the interval
is not resolved by that run.
"""
from __future__ import annotations

import random
import statistics


def paired_ratio(base: list, other: list, resamples: int = 2000) -> tuple:
    """``(median, low, high)`` of ``base[k] / other[k]`` over repeats ``k``; ``low``-``high`` the 90% interval."""
    ratios = [b / o for b, o in zip(base, other, strict=True)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.05 * resamples)], meds[int(0.95 * resamples) - 1]
