"""What one message step costs when ``P`` of our processes share this machine's cores: the ``sync`` curve.

    from sync_probe import sync_latency; sync_latency((2, 4, 8))  ->  [[2, us], [4, us], [8, us]]

With more processes than cores, a rank that reaches a collective or a
pipeline hand-off often finds its peer off its core and waits for the
scheduler to run it; processor sharing of the cores (``Cluster.thread_rate``)
does not see that wait, and an idle two-rank ping-pong does not either.
This probe makes it happen as training does: ``P`` ranks of the shared rank
pool (``toolkit.rank_pool``, one intra-op thread each) in pairs ``(0, 1),
(2, 3), ...``, all at once, each round computing a ``busy``-sized matmul and
then all-reducing 4 bytes with its partner (``sbp_core.boxing.collectives``);
the same matmul timed alone in between is subtracted, so what is left,
``E``, is the wall time a 2-step all-reduce adds to a round.

The simulator runs a collective inside its actor, at the speed processor
sharing gives the actor's threads (``rate``, about the share of a core each
process gets), so the latency per message step written here is
``E * share / 2`` with ``share`` the CPU time over the wall time of the lone
matmul (the share of a core the process had while computing): priced that
way, the simulator reproduces the probe's rounds. No step time of a layout
enters it.
"""
from __future__ import annotations

import statistics
import time

import torch


def _sync_worker(rounds: int, busy: int) -> tuple:
    """On every rank: ``(extra wall seconds per round from the all-reduce, share of a core while computing)``."""
    import sbp_core as sc
    from sbp_core.boxing.collectives import all_reduce
    from sbp_core.process_groups import world_rank, world_size

    torch.set_num_threads(1)
    p, r = world_size(), world_rank()
    sc.placement("cpu", [[2 * i, 2 * i + 1] for i in range(p // 2)])  # builds the pairs' groups on every rank
    pair = [r - r % 2, r - r % 2 + 1]
    small, a = torch.zeros(1), torch.randn(busy, busy)
    all_reduce(small, pair, "sum")
    alone, cpu, both = [], [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        a @ a
        alone.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        t0 = time.perf_counter()
        a @ a
        all_reduce(small, pair, "sum")
        both.append(time.perf_counter() - t0)
    wall = statistics.median(alone)
    return max(0.0, statistics.median(both) - wall), min(1.0, statistics.median(cpu) / wall)


def sync_latency(ns=(2, 4, 8), busy: int = 256, rounds: int = 60) -> list:
    """``[[P, microseconds per message step]]`` with ``P`` of our processes in pairs on this machine (see above)."""
    from toolkit.rank_pool import get_pool

    out = []
    for p in ns:
        if p < 2 or p % 2:
            raise ValueError(f"sync probe with {p} processes: they pair up, so use an even number >= 2")
        res = get_pool(p, timeout=120).run(_sync_worker, rounds, busy)
        extra = max(e for e, _ in res)  # a pair's all-reduce ends when its later rank gets there
        share = statistics.median(s for _, s in res)
        out.append([p, round(extra * share / 2 * 1e6, 1)])
    return out
