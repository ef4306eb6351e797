"""A cluster's topology and speeds, from the dict of a YAML file (``configs/cluster/*.yaml``; ``toolkit.search`` reads it).

::

    name: v100-4x8
    nodes: 4
    devices_per_node: 8
    device:
      kind: V100-SXM2-32GB
      memory_gib: 32
      peak_tflops: {float32: 15.7, float16: 125.0, bfloat16: 125.0}
      memory_bandwidth_gbs: 900
      kernel_overhead_us: 5      # launch cost per kernel
      host_overhead_us: 20       # Python dispatch per op on global tensors (overlaps device work)
    links:
      intra_node: {bandwidth_gbs: 150, latency_us: 5}    # per device (NVLink)
      inter_node: {bandwidth_gbs: 12.5, latency_us: 10}  # per node (its NICs), shared by its devices

A machine whose devices are processes sharing a CPU (``this_machine.yaml``,
written by ``scripts/calibrate_machine.py``) instead says ``costs: measured``
(per-op seconds measured here, ``toolkit.search.opcost``), how many
``cores`` there are, ``capacity``: ``[[busy threads, cores they get], ...]``
(other jobs take the rest), ``contention``: ``[[busy processes, CPU time per
unit of work relative to one process], ...]`` (oversubscribed cores and a
shared cache slow every process down), ``device.dispatch_us`` (our Python cost per
global op), ``device.kernel_factor`` (kernels inside a step vs alone),
``device.thread_speedup`` (a process with 2 intra-op threads vs
1 on the kernels torch splits over threads; used when no per-call gain is
measured, ``threadgain``), ``sync``: ``[[processes, latency_us], ...]``
(the latency of one message step inside the node when that many of our
processes share the cores: a step waits for a peer that is off its core;
measured by ``scripts/calibrate_machine.py``, it replaces
``links.intra_node.latency_us``), ``skew``: ``[[processes, fraction], ...]``
(what a collective inside the node waits beyond its message steps, as a
fraction of the compute since the rank's previous collective: the ranks
drift apart while computing — one loses its core, another does not — and
the collective waits for the latest; ``benchkit/sync_probe.py``), and
``memory_shared: true`` (all processes share the node's ``memory_gib``).

Device ``d`` is on node ``d // devices_per_node``; a job's rank ``r`` is
device ``r``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # seconds per message step


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    memory: float  # bytes per device (or per node when memory_shared)
    intra: Link
    inter: Link
    peak_flops: dict = field(default_factory=dict)  # dtype -> FLOP/s
    mem_bandwidth: float = 0.0  # bytes/s
    kernel_overhead: float = 0.0  # s per kernel
    host_overhead: float = 0.0  # s per global op (Python dispatch)
    costs: str = "roofline"  # or "measured"
    cores: float = 0.0  # CPU cores the devices share (measured machines); 0 = each device has its own processor
    capacity: tuple = ()  # ((busy threads, cores they get), ...)
    thread_speedup: float = 1.0
    kernel_factor: float = 1.0  # measured kernels take this much longer inside a step than alone
    contention: tuple = ()  # ((busy processes, CPU time per unit of work relative to one), ...)
    sync: tuple = ()  # ((processes sharing the cores, seconds per message step inside the node), ...)
    skew: tuple = ()  # ((processes sharing the cores, wait per second of compute since the last collective), ...)
    probe_step: float = 0.0  # CPU seconds of the calibration's contention probe step alone (measured machines)
    memory_shared: bool = False
    source: str = ""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def threads_per_device(self, processes: int) -> int:
        """Intra-op threads of each process when ``processes`` share this machine (the launcher's rule)."""
        if not self.cores:
            return 1
        return max(1, int(self.cores) // processes)

    def device_memory(self, devices_used: int) -> float:
        """Bytes one device may hold when ``devices_used`` devices run (shared memory is split evenly)."""
        if self.memory_shared:
            per_node = min(devices_used, self.devices_per_node)
            return self.memory / max(1, per_node)
        return self.memory

    def cores_for(self, threads: float) -> float:
        """Cores ``threads`` busy threads of ours get (``capacity``; all they want up to ``cores`` if unmeasured)."""
        if not self.cores:
            return float("inf")
        if not self.capacity:
            return min(threads, self.cores)
        return _interpolate(self.capacity, threads, through_origin=True)

    def step_latency(self, processes: float) -> float:
        """Seconds of one message step inside a node with ``processes`` of ours sharing its cores (``sync``)."""
        if not self.sync:
            return self.intra.latency
        return _interpolate(self.sync, processes)

    def skew_fraction(self, processes: float) -> float:
        """Seconds a collective in a node waits per second of compute since the previous one (``skew``, else 0)."""
        return _interpolate(self.skew, processes) if self.skew else 0.0

    def thread_rate(self, threads: float) -> float:
        """Speed of each of ``threads`` busy threads: its share of the cores, over the contention slowdown."""
        share = min(1.0, self.cores_for(threads) / threads) if threads > 0 else 1.0
        slow = _interpolate(self.contention, threads) if self.contention else 1.0
        return share / max(1.0, slow)


def _interpolate(points, x: float, through_origin: bool = False) -> float:
    """Piecewise-linear through ``points`` ((x, y), ...); flat beyond the last, and below the first unless ``through_origin``."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1] * x / pts[0][0] if through_origin else pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ValueError(f"cluster file {where}: missing key {key!r}")
    return d[key]


def _link(d: dict, where: str) -> Link:
    return Link(float(_need(d, "bandwidth_gbs", where)) * GB, float(_need(d, "latency_us", where)) * 1e-6)


def cluster_from_dict(d: dict, source: str = "<dict>") -> Cluster:
    known = {"name", "nodes", "devices_per_node", "device", "links", "cores", "capacity", "contention", "costs", "sync",
             "skew"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"cluster file {source}: unknown keys {unknown}; valid: {sorted(known)}")
    dev = _need(d, "device", source)
    links = _need(d, "links", source)
    costs = str(d.get("costs", "roofline"))
    if costs not in ("roofline", "measured"):
        raise ValueError(f"cluster file {source}: costs={costs!r}; valid: roofline, measured")
    peak = {k: float(v) * 1e12 for k, v in (dev.get("peak_tflops") or {}).items()}
    if costs == "roofline" and "float32" not in peak:
        raise ValueError(f"cluster file {source}: a roofline device needs device.peak_tflops.float32")
    nodes, per = int(_need(d, "nodes", source)), int(_need(d, "devices_per_node", source))
    if nodes < 1 or per < 1:
        raise ValueError(f"cluster file {source}: nodes={nodes}, devices_per_node={per}: both must be >= 1")
    intra = _link(_need(links, "intra_node", source), f"{source} links.intra_node")
    inter = _link(links["inter_node"], f"{source} links.inter_node") if "inter_node" in links else intra
    return Cluster(
        name=str(d.get("name", source)), nodes=nodes, devices_per_node=per,
        memory=float(_need(dev, "memory_gib", source)) * 2**30, intra=intra, inter=inter, peak_flops=peak,
        mem_bandwidth=float(dev.get("memory_bandwidth_gbs", 0.0)) * GB,
        kernel_overhead=float(dev.get("kernel_overhead_us", 0.0)) * 1e-6,
        host_overhead=float(dev.get("host_overhead_us", dev.get("dispatch_us", 0.0))) * 1e-6,
        costs=costs, cores=float(d.get("cores", 0.0)),
        capacity=tuple((float(n), float(c)) for n, c in (d.get("capacity") or ())),
        contention=tuple((float(n), float(c)) for n, c in (d.get("contention") or ())),
        sync=tuple((float(n), float(us) * 1e-6) for n, us in (d.get("sync") or ())),
        skew=tuple((float(n), float(f)) for n, f in (d.get("skew") or ())),
        probe_step=float(dev.get("probe_step_s", 0.0)),
        thread_speedup=float(dev.get("thread_speedup", 1.0)), kernel_factor=float(dev.get("kernel_factor", 1.0)),
        memory_shared=bool(dev.get("memory_shared", False)),
        source=source)
