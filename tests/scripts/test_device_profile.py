"""benchkit.device_profile: the per-step reduction of profiler events, the sync-site probe, a CPU profile."""
from __future__ import annotations

import gzip
import json
import threading
import warnings

import pytest
import torch

from benchkit.device_profile import SPAN, Event, profile_steps, reduce, sync_sites


def _events():
    """Two steps in a 10 us span; device work partly after it; events outside the span that must not count."""
    return [
        Event(SPAN, False, 1_000, 10_000, annotation=True),
        Event(SPAN, True, 1_000, 13_000, annotation=True),  # the device-side copy of the span: not work
        Event("Optimizer.step#AdamW.step", False, 9_800, 100, annotation=True),  # torch's own region
        Event("Optimizer.step#AdamW.step", True, 9_000, 5_000),  # its device side, even if not flagged
        Event("early_kernel", True, 0, 500),  # ended before the span
        Event("gemm", True, 2_000, 3_000),
        Event("gelu", True, 4_000, 2_000),  # overlaps gemm (another stream): 2..6 us busy
        Event("Memcpy HtoD (Pageable -> Device)", True, 7_000, 200),  # the step's own copy
        Event("Memcpy HtoD (Pinned -> Device)", True, 8_000, 1_000),  # a read-ahead's: not the step's work
        Event("Memcpy HtoD (Pinned -> Device)", True, 15_000, 1_000),  # nor one that ends after its work
        Event("Memcpy DtoH (Device -> Pageable)", True, 9_500, 500),
        Event("adam", True, 10_500, 3_500),  # runs past the span: the window ends at 14 us
        Event("cudaLaunchKernel", False, 1_500, 10),
        Event("cuLaunchKernel", False, 3_500, 10),
        Event("cudaLaunchKernelExC_v11060", False, 9_000, 10),
        Event("cudaMemcpyAsync", False, 9_100, 10),  # not a blocking call
        Event("cudaStreamSynchronize", False, 9_400, 700),
        Event("cudaEventSynchronize", False, 5_000, 300, thread=7),  # a read-ahead worker's: not the step's
        Event("aten::mm", False, 1_400, 300),
        Event("cudaDeviceSynchronize", False, 11_500, 2_600),  # the probe's own synchronize, after the span
    ]


def test_reduce_takes_the_union_of_device_intervals_and_counts_per_step():
    p = reduce(_events(), steps=2)
    assert p.steps == 2
    assert p.wall_ms == pytest.approx((14_000 - 1_000) / 2 / 1e6)
    assert p.busy_ms == pytest.approx((4_000 + 200 + 500 + 3_500) / 2 / 1e6)
    assert p.launches == 1.5 and p.waits == 0.5 and p.waits_elsewhere == 0.5
    assert p.copies == {"HtoD": 1.5, "DtoH": 0.5}
    head = p.lines("ours")[0]
    assert "device busy" in head and "(63%)" in head and "1.5 launches" in head, head
    assert "copies 1.5 HtoD 0.5 DtoH 0 DtoD" in head and "blocking calls 0.5 (other threads 0.5)" in head, head


def test_waits_are_not_told_apart_where_no_launch_carries_the_stepping_threads_id():
    events = [Event(e.name, e.on_device, e.start_ns, e.dur_ns, e.annotation, 3 if e.thread == 0 else e.thread)
              if not e.on_device and e.name != SPAN else e for e in _events()]
    p = reduce(events, steps=2)
    assert p.waits == 1.0 and p.waits_elsewhere is None
    assert p.lines("ours")[0].endswith("blocking calls 1")


def test_reduce_without_device_events_gives_the_span_and_refuses_a_missing_span():
    host = [e for e in _events() if not e.on_device]
    p = reduce(host, steps=4)
    assert p.wall_ms == pytest.approx(10_000 / 4 / 1e6) and p.busy_ms is None and p.launches is None
    assert "no device activity" in p.lines("plain")[0]
    with pytest.raises(ValueError, match="one host"):
        reduce([e for e in host if e.name != SPAN], steps=1)


def _synchronizing_op():
    warnings.warn("called a synchronizing CUDA operation")  # what torch's sync debug mode raises


def test_sync_sites_counts_the_calling_line_in_any_thread_and_passes_other_warnings_on():
    line = _synchronizing_op.__code__.co_firstlineno + 1
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with sync_sites() as sites:
            _synchronizing_op()
            t = threading.Thread(target=_synchronizing_op, name="copy")
            t.start()
            t.join()
            warnings.warn("something else")
        _synchronizing_op()  # after the block: an ordinary warning again
    site = f"tests/scripts/test_device_profile.py:{line} (_synchronizing_op) on thread"
    assert sites == {f"{site} {threading.current_thread().name}": 1, f"{site} copy": 1}, sites
    assert [str(w.message) for w in others] == ["something else", "called a synchronizing CUDA operation"]


def test_a_cpu_profile_times_the_steps_and_writes_a_trace(tmp_path):
    x = torch.randn(64, 64)
    seen = []

    def step(i):
        seen.append(i)
        return (x @ x).sum()

    trace = tmp_path / "t.json.gz"
    p = profile_steps(step, range(5, 8), "cpu", str(trace))
    assert seen == [5, 6, 7] and p.steps == 3 and p.wall_ms > 0 and p.busy_ms is None and not p.sites
    with gzip.open(trace) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert SPAN in names and "aten::mm" in names
