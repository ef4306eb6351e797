"""Seconds of a rehearsed phase on a cluster: local ops priced by an op cost model, collectives by links.

A collective's time is ``steps * latency + bytes / bandwidth``, with the
bytes this rank sends (the communication ledger's count, which sums to
DESIGN.md's boxing cost table over the ranks) and the steps of its
algorithm (ring all-reduce ``2(p-1)``, all-gather / reduce-scatter /
all-to-all ``p-1``, a send 1). The link is the node's own (NVLink,
shared memory) when every rank of the group is on one node, else the
network: a node's inter-node bandwidth is shared by all of the stage's
devices on that node, since in a stage every device runs the same
collective at once (SPMD).

A phase's work is, on a device with its own processor, ``max(device time,
host time)`` — the host enqueues kernels while the device runs them — plus
the collectives (our runtime runs them inside the action, so they do not
overlap compute); on a measured CPU machine, where the host *is* the
device, their sum.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .rehearsal import Collective, OpCall, PhaseTrace, TensorSpec

_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1,
          "all_to_all": lambda p: p - 1, "reduce": lambda p: p - 1, "send": lambda p: 1, "broadcast": lambda p: 1,
          "all_gather_object": lambda p: 2 * (p - 1)}
GRAIN = 32768  # elements below which torch's CPU kernels run on one thread (at::internal::GRAIN_SIZE)


def link_for(cluster: Cluster, devices, stage_devices) -> tuple:
    """``(Link, sharers)``: the link a group of ``devices`` uses and how many devices share its bandwidth."""
    nodes = {cluster.node_of(d) for d in devices}
    if len(nodes) == 1:
        return cluster.intra, 1
    node = cluster.node_of(devices[0])
    return cluster.inter, max(1, sum(1 for d in stage_devices if cluster.node_of(d) == node))


def collective_seconds(c: Collective, cluster: Cluster, devices, stage_devices) -> float:
    p = max(2, len(devices))
    steps = _STEPS.get(c.op, lambda p: p - 1)(p)
    link, sharers = link_for(cluster, devices, stage_devices)
    return steps * link.latency + c.bytes * sharers / link.bandwidth


def _largest(spec) -> int:
    if isinstance(spec, TensorSpec):
        n = 1
        for s in spec.shape:
            n *= s
        return n
    if isinstance(spec, tuple):
        return max((_largest(s) for s in spec), default=0)
    return 0


@dataclass(frozen=True)
class PhaseCost:
    """``seconds`` = the phase's work; its parts for reports.

    ``threaded``: the part of ``compute`` spent in kernels big enough to use
    all of the process's intra-op threads (the rest keeps one thread busy).
    """

    seconds: float
    compute: float
    host: float
    comm: float
    threaded: float = 0.0


def phase_cost(trace: PhaseTrace, op_costs, cluster: Cluster, offset: int, stage_devices, threads: int = 1) -> PhaseCost:
    """Price ``trace`` for a stage whose rank ``r`` is device ``offset + r`` (``stage_devices``: all of its devices)."""
    compute = comm = threaded = 0.0
    speedup = cluster.thread_speedup if threads > 1 else 1.0
    for e in trace.events:
        if isinstance(e, OpCall):
            s = op_costs.seconds(e) * cluster.kernel_factor
            if threads > 1 and _largest(e.args) >= GRAIN:
                s /= speedup
                threaded += s
            compute += s
        else:
            comm += collective_seconds(e, cluster, tuple(offset + r for r in e.ranks), stage_devices)
    host = len(trace.global_ops) * cluster.host_overhead
    busy = compute + host if cluster.costs == "measured" else max(compute, host)
    return PhaseCost(busy + comm, compute, host, comm, threaded)
