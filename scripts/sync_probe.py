"""What a collective costs when ``P`` of our processes share this machine's cores: the ``sync`` and ``skew`` curves.

    from sync_probe import sync_latency; sync_latency((2, 4, 8))  ->  [[2, us, skew], [4, us, skew], [8, us, skew]]

With more processes than cores, a rank that reaches a collective or a
pipeline hand-off often finds its peer off its core and waits for the
scheduler to run it; and even with a core each, two ranks that computed
the same work drift apart (one loses its core to another job for a while,
the other does not), so a collective waits for the later one — the longer
they computed since their last collective, the longer. This probe makes
both happen as training does: ``P`` ranks of the shared rank pool
(``toolkit.rank_pool``, one intra-op thread each) in pairs ``(0, 1), (2,
3), ...``, all at once, in alternating blocks of rounds: a matmul alone
(``A`` wall seconds a round: the processor sharing of the cores now, ``c``
CPU seconds of it), or a matmul then a 4-byte all-reduce with the partner
(``W``; ``sbp_core.boxing.collectives``), for a small and a large matmul.

The result is in the simulator's own terms, so that priced with it the
simulator reproduces the probe's rounds: it runs a round as ``c + 2 *
latency + skew * c`` seconds of work (2 message steps of a two-rank
all-reduce) at the speed processor sharing gives the process, which
already stretches ``c`` to ``A``; so the work the all-reduce adds is
``(W - A) * c / A``, and a line through the two matmul sizes splits it into
the part that grows with the compute before the collective (``skew``, per
second of it) and the part that does not (``2 * latency``). No step time of
a layout enters it. (The earlier probe timed the lone matmul inside the
rounds, where a rank often had a core to itself while the other pairs
waited, and so charged the other pairs' compute to the message steps again
on top of processor sharing: 4 processes on 2 cores came out at 650 us a
step, and tp4 over-predicted.)
"""
from __future__ import annotations

import statistics
import time

import torch

BUSY = (160, 448)  # matmul sizes: about 0.3 ms and 6 ms of one core, a tensor-parallel layer's span on gpt2-tiny


def _sync_worker(rounds: int, busy: int, blocks: int = 8) -> tuple:
    """On every rank: wall seconds per round of matmuls alone and of matmul + all-reduce, CPU seconds per matmul.

    All ranks run both kinds of round at once, in alternating blocks (drifting
    load hits both alike): rounds of matmuls alone measure the processor
    sharing of the cores now, rounds with the all-reduce what it adds.
    """
    import torch.distributed as dist

    import sbp_core as sc
    from sbp_core.boxing.collectives import all_reduce
    from sbp_core.process_groups import world_rank, world_size

    torch.set_num_threads(1)
    p, r = world_size(), world_rank()
    sc.placement("cpu", [[2 * i, 2 * i + 1] for i in range(p // 2)])  # builds the pairs' groups on every rank
    pair = [r - r % 2, r - r % 2 + 1]
    small, a = torch.zeros(1), torch.randn(busy, busy)
    all_reduce(small, pair, "sum")
    n = max(1, rounds // blocks)
    alone = both = cpu = 0.0
    for _ in range(blocks):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            a @ a
        alone += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
            all_reduce(small, pair, "sum")
        both += time.perf_counter() - t0
    k = n * blocks
    return alone / k, both / k, cpu / k


def sync_latency(ns=(2, 4, 8), busy=BUSY, rounds: int = 64) -> list:
    """``[[P, microseconds per message step, skew]]`` with ``P`` of our processes in pairs (see above)."""
    from toolkit.rank_pool import get_pool

    out = []
    for p in ns:
        if p < 2 or p % 2:
            raise ValueError(f"sync probe with {p} processes: they pair up, so use an even number >= 2")
        points = []
        for b in busy:
            res = get_pool(p, timeout=120).run(_sync_worker, rounds, b)
            alone = statistics.median(r[0] for r in res)
            both = max(r[1] for r in res)  # a pair's all-reduce ends when its later rank gets there
            c = statistics.median(r[2] for r in res)
            points.append((c, max(0.0, both - alone) * min(1.0, c / alone)))
        (c1, w1), (c2, w2) = points[0], points[-1]
        skew = max(0.0, (w2 - w1) / (c2 - c1)) if c2 > c1 else 0.0
        fixed = max(0.0, w1 - skew * c1)
        out.append([p, round(fixed / 2 * 1e6, 1), round(skew, 4)])
    return out
