"""Measure this machine for the simulator and write ``configs/cluster/this_machine.yaml``.

    python scripts/calibrate_machine.py [--out configs/cluster/this_machine.yaml] [--devices 8]

A "device" here is one process of ours; the devices share the CPU. Measured:

- ``capacity``: cores our busy threads actually get, for 1, 2, 4 and 8 busy
  processes spinning at once (other jobs on the machine take the rest;
  on an idle machine this is ``min(n, cores)``);
- ``contention``: CPU seconds per training step (a small GPT-2, one thread)
  when 1, 2, 4 and 8 processes step at once, relative to one alone: the
  slowdown of shared caches and of more processes than cores;
- ``device.thread_speedup``: what 2 intra-op threads give the kernels of a
  one-process training step (the large calibration GPT-2's): its kernels'
  one-thread seconds over their seconds divided by each call's measured gain
  (``toolkit.search.threadgain``, the same per-call gains the simulator uses,
  cached in ``op-costs-<host>-threads2.json``). A whole step timed with 2
  threads vs 1 is no measure of it: under load the second thread waits for a
  core at every kernel's barrier (such a probe said 1.1x where a gpt2-tiny
  step gains 1.6x); the simulator uses it only for cost models without
  per-call gains;
- ``sync`` and ``skew``: the latency of one message step when 2, 4 and 8 of
  our processes share the cores (a peer off its core makes the step wait),
  and what a collective waits on top per second of compute since the rank's
  previous one (ranks drift apart while computing) (``benchkit/sync_probe.py``);
- ``device.dispatch_us`` and ``device.kernel_factor``: our cost per op on
  global tensors beyond its kernel, and how much longer kernels take inside
  a step than measured alone (cold caches, fresh memory) — from two real
  one-device GPT-2 steps (forward, backward, AdamW; process CPU time, best
  of 20), one dispatch-bound and one kernel-bound, against the measured
  kernels of the same calls (from a rehearsal, ``toolkit.search``);
- ``device.memory_bandwidth_gbs``: best-of copy of 64 MB on one thread;
- ``links.intra_node``: two gloo ranks (``toolkit.rank_pool``) all-reducing
  4 bytes (latency: half the median round) and 8 MB (bandwidth from the
  ring formula), through ``sbp_core.boxing.collectives``.

Per-op kernel times are not written here: ``toolkit.search.opcost.MeasuredOpCosts``
measures each distinct call once, on first use, into
``~/.cache/sbp-recipes/op-costs-<host>.json``. Takes about a minute.
"""

from __future__ import annotations

import argparse

from benchkit.calibration import ROOT, calibrate
from runtime.host_memory import keep_freed_host_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "configs" / "cluster" / "this_machine.yaml"))
    ap.add_argument("--devices", type=int, default=8, help="processes the search may use")
    o = ap.parse_args()
    keep_freed_host_memory()  # the one-process steps run with a training rank's host memory
    print(calibrate(o.out, o.devices))


if __name__ == "__main__":
    main()
