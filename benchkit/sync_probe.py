"""What a collective costs when ``P`` of our processes share this machine's cores: the ``sync`` and ``skew`` curves.

    from benchkit.sync_probe import sync_latency; sync_latency((2, 4, 8))  ->  [[2, us, skew], [4, us, skew], [8, us, skew]]

With more processes than cores, a rank that reaches a collective or a
pipeline hand-off often finds its peer off its core and waits for the
scheduler to run it; and even with a core each, two ranks that computed
the same work drift apart (one loses its core to another job for a while,
the other does not), so a collective waits for the later one — the longer
they computed since their last collective, the longer. This probe makes
both happen as training does: ``P`` ranks of the shared rank pool
(``toolkit.rank_pool``, one intra-op thread each) in pairs ``(0, 1), (2,
3), ...``, all at once, each round a matmul then a 4 KiB all-reduce with
the partner (``MESSAGE``; ``sbp_core.boxing.collectives``), for a small
and a large matmul. Every rank stamps each round on the machine's monotonic clock
(one clock for all processes): when it started computing, when it reached
the all-reduce, when it left it. Per pair and round that gives, in the same
rounds (so drifting load hits all of it alike):

- the *lag*: how much later than the pair's mean arrival the later rank
  reached the all-reduce (half the gap: the simulator's rank is the mean
  rank, which processor sharing times, and the pair goes on when its later
  rank has arrived);
- the *segment*: the wall time the ranks computed since the last one;
- the *latency*: the later rank's time in the all-reduce (nobody to wait for);
- the *share* of a core a rank had: the matmul's CPU time over its wall time.

In the simulator's terms (work at the speed processor sharing gives the
process, which already stretches compute to its wall time): ``skew`` is
the slope of the mean lag over the mean segment between the two matmul
sizes (a wall-time ratio, so the same ratio of work), and the latency of a
message step is the mean latency plus the lag's fixed part, as work
(times the share), over the 2 message steps of a two-rank all-reduce. No
step time of a layout enters it. (The probe before this one timed a lone
matmul inside the rounds, where a rank often had a core to itself while
the other pairs waited, and so charged the other pairs' compute to the
message steps on top of processor sharing: 4 processes on 2 cores came out
at 650 us a step, and tp4 over-predicted; and it had no skew.)
"""
from __future__ import annotations

import statistics
import time

import torch

# Matmul sizes: about 0.2 and 20 ms of one core; gpt2-tiny's tensor-parallel collectives are 0.3-35 ms of compute apart.
BUSY = (160, 896)
# Elements of the probe's all-reduce (fp32): 4 KiB, the size class of a training step's collectives. On this
# 2-core VM a 4-byte all-reduce is the fast case: with 2 processes 0.2-0.5 ms, while one of 4 KiB or more takes
# 1.8-3.9 ms once both ranks arrived, in tp2 steps of gpt2-tiny (72 activation all-reduces of 512 KiB: 1.8-2.4 ms)
# and in this probe alike; a 4-byte probe put the message step at 190 us, a 4 KiB one at 710 us.
MESSAGE = 1024


def _sync_worker(rounds: int, busy: int, numel: int = MESSAGE) -> list:
    """On every rank: ``[(start, reached the all-reduce, left it, CPU seconds of the matmul)]`` per round."""
    import sbp_core as sc
    from sbp_core.boxing.collectives import all_reduce
    from sbp_core.process_groups import world_rank, world_size

    torch.set_num_threads(1)
    p, r = world_size(), world_rank()
    sc.placement("cpu", [[2 * i, 2 * i + 1] for i in range(p // 2)])  # builds the pairs' groups on every rank
    pair = [r - r % 2, r - r % 2 + 1]
    small, a = torch.zeros(numel), torch.randn(busy, busy)
    all_reduce(small, pair, "sum")
    out = []
    for _ in range(rounds):
        t0, c0 = time.monotonic(), time.thread_time()
        a @ a
        t1, c1 = time.monotonic(), time.thread_time()
        all_reduce(small, pair, "sum")
        out.append((t0, t1, time.monotonic(), c1 - c0))
    return out


def pair_rounds(stamps: list) -> tuple:
    """Means over pairs and rounds (the highest 5% left out) of ``(lag, segment, latency, share)`` (see above)."""
    lags, segments, latencies, shares = [], [], [], []
    for i in range(0, len(stamps), 2):
        for a, b in zip(stamps[i], stamps[i + 1]):
            early, late = (a, b) if a[1] <= b[1] else (b, a)
            lags.append((late[1] - early[1]) / 2)
            segments.append((a[1] - a[0] + b[1] - b[0]) / 2)
            latencies.append(late[2] - late[1])
            shares += [min(1.0, x[3] / (x[1] - x[0])) for x in (a, b) if x[1] > x[0]]
    return tuple(_trimmed_mean(x) for x in (lags, segments, latencies, shares))


def _trimmed_mean(xs: list, cut: float = 0.05) -> float:
    """The mean without the highest ``cut`` of the values: a rank stalled for a second by another job in one
    round would otherwise set the latency of every message step (a mean, not a median: the waits are what add up)."""
    xs = sorted(xs)
    return statistics.fmean(xs[: len(xs) - int(len(xs) * cut)])


def sync_latency(ns=(2, 4, 8), busy=BUSY, rounds: int = 48, numel: int = MESSAGE) -> list:
    """``[[P, microseconds per message step, skew]]`` with ``P`` of our processes in pairs (see above)."""
    from toolkit.rank_pool import get_pool

    out = []
    for p in ns:
        if p < 2 or p % 2:
            raise ValueError(f"sync probe with {p} processes: they pair up, so use an even number >= 2")
        points = [pair_rounds(get_pool(p, timeout=120).run(_sync_worker, rounds, b, numel)) for b in busy]
        (w1, s1, l1, h1), (w2, s2, l2, h2) = points[0], points[-1]
        skew = max(0.0, (w2 - w1) / (s2 - s1)) if s2 > s1 else 0.0
        fixed = max(0.0, w1 - skew * s1) + l1
        out.append([p, round(fixed * h1 / 2 * 1e6, 1), round(skew, 4)])
    return out
