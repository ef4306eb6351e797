"""Paired ratios of two timed ways that ran side by side, with a bootstrap interval.

Each repeat (a round of every way, run within seconds of each other) gives
one ratio ``base / other`` of times, i.e. ``other``'s throughput over
``base``'s; drift of the machine between repeats cancels in it. The median
over repeats, and its 90% bootstrap interval (repeats resampled with
replacement), say how well a run resolves a bar: a bar inside the interval
is not resolved by that run.

``balanced_orders`` gives the orders to run the ways in, round by round:
each way in each position equally often and right after each other way
equally often, so neither a slot in the round nor the way before (a
DataLoader's exiting workers, a peer's freed memory) favours one way.
``timed_steps`` runs training steps in those orders and times them.
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


def balanced_orders(names: list) -> list:
    """A Williams design over ``names``: ``n`` orders (``2n`` for odd ``n``), each name once per order.

    Across the orders every name takes every position, and follows every
    other name, equally often (twice for odd ``n``, once for even).
    """
    n = len(names)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(k + i) % n for k in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[k] for k in row] for row in rows]


def timed_steps(ways: dict, steps: int, warmup: int, before, read) -> tuple:
    """Each way's step ``warmup + steps`` times, round by round in ``balanced_orders``, ``before()`` ahead of
    each (a barrier across ranks, so that no rank's wait counts in the next way's time).

    Returns ``(times, values)``: per way, the seconds of the timed steps (after the warm-up), and ``read`` of
    what each warm-up step returned (its loss, read outside the timed steps)."""
    import time

    orders = balanced_orders(list(ways))
    times, values = {k: [] for k in ways}, {k: [] for k in ways}
    for i in range(warmup + steps):
        for name in orders[i % len(orders)]:
            before()
            t0 = time.perf_counter()
            out = ways[name]()
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(elapsed)
            else:
                values[name].append(read(out))
    return times, values
