"""Seconds of a rehearsed phase on a cluster: local ops priced by an op cost model, collectives by links.

A collective's time is ``steps * latency + bytes / bandwidth``, with the
bytes this rank sends (the communication ledger's count, which sums to
docs/design.md's boxing cost table over the ranks) and the steps of its
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
from .rehearsal import Collective, OpCall, PhaseTrace
from .threadgain import threadable

_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1,
          "all_to_all": lambda p: p - 1, "reduce": lambda p: p - 1, "send": lambda p: 1, "broadcast": lambda p: 1,
          "all_gather_object": lambda p: 2 * (p - 1)}


def link_for(cluster: Cluster, devices, stage_devices) -> tuple:
    """``(Link, sharers)``: the link a group of ``devices`` uses and how many devices share its bandwidth."""
    nodes = {cluster.node_of(d) for d in devices}
    if len(nodes) == 1:
        return cluster.intra, 1
    node = cluster.node_of(devices[0])
    return cluster.inter, max(1, sum(1 for d in stage_devices if cluster.node_of(d) == node))


def collective_seconds(c: Collective, cluster: Cluster, devices, stage_devices, processes: int = 0,
                       segment: float = 0.0) -> float:
    """Seconds of collective ``c`` over ``devices``; ``processes``: how many of the job's processes share the cores.

    Inside a node whose devices share cores, a message step's latency is the
    cluster's ``sync`` curve at ``processes`` when measured
    (``Cluster.step_latency``): with more processes than cores a step waits
    for a peer that is off its core. On top, the collective waits for the
    group's latest rank: ``skew_fraction(processes)`` of the ``segment``
    seconds of compute since this rank's previous collective (ranks that
    computed longer drifted further apart).
    """
    p = max(2, len(devices))
    steps = _STEPS.get(c.op, lambda p: p - 1)(p)
    link, sharers = link_for(cluster, devices, stage_devices)
    one_node = len({cluster.node_of(d) for d in devices}) == 1
    latency = cluster.step_latency(processes) if one_node and cluster.sync else link.latency
    drift = cluster.skew_fraction(processes) * segment if one_node and len(devices) > 1 else 0.0
    return steps * latency + drift + c.bytes * sharers / link.bandwidth


@dataclass(frozen=True)
class PhaseCost:
    """``seconds`` = the phase's work; its parts for reports.

    ``thread_seconds``: busy-thread seconds the phase keeps the CPU busy
    (``seconds`` with one thread; with more, a kernel sped up ``g``-fold by
    them keeps ``g`` threads busy: its one-thread work is conserved).
    """

    seconds: float
    compute: float
    host: float
    comm: float
    thread_seconds: float = 0.0


def phase_cost(trace: PhaseTrace, op_costs, cluster: Cluster, offset: int, stage_devices, threads: int = 1,
               gains=None, processes: int = 0, plain: bool = False) -> PhaseCost:
    """Price ``trace`` for a stage whose rank ``r`` is device ``offset + r`` (``stage_devices``: all of its devices).

    With ``threads`` > 1 a kernel runs ``gain`` times faster: ``gains.gain(call)``
    when a per-call measurement is given (``threadgain.MeasuredThreadGain``),
    else the cluster's ``thread_speedup`` for kernels torch splits over threads
    (``threadgain.threadable``). ``processes``, and the compute since the
    previous collective of the phase (or its start) a collective waits on: see
    ``collective_seconds``.
    """
    compute = comm = work = segment = 0.0
    for e in trace.events:
        if isinstance(e, OpCall):
            s = op_costs.seconds(e) * cluster.kernel_factor
            gain = 1.0
            if threads > 1:
                gain = gains.gain(e) if gains is not None else (cluster.thread_speedup if threadable(e) else 1.0)
            compute += s / gain
            segment += s / gain
            work += s
        else:
            comm += collective_seconds(e, cluster, tuple(offset + r for r in e.ranks), stage_devices, processes,
                                       segment)
            segment = 0.0
    # A stage that runs on plain tensors (``StageTrace.plain``: one device, or pure data parallel) pays no dispatch.
    host = 0.0 if plain or len(stage_devices) == 1 else len(trace.global_ops) * cluster.host_overhead
    busy = compute + host if cluster.costs == "measured" else max(compute, host)
    return PhaseCost(busy + comm, compute, host, comm, work + host + comm)
