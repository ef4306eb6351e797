"""Where a step's time goes on a GPU: how long the device was busy, what the host launched, where it waited.

    from benchkit.device_profile import profile_steps
    prof = profile_steps(way.step, range(first, first + 2), "cuda")    # a StepProfile
    print("\\n".join(prof.lines("ours")))

``profile_steps`` runs the steps under ``torch.profiler`` (CPU and, on
CUDA, CUDA activities) and under ``torch.cuda.set_sync_debug_mode("warn")``
inside a ``record_function`` span, then synchronizes the device. Per step:

- ``wall``: from the span's start to the end of the last device activity
  the steps queued (the span's end where nothing ran on a device);
- ``busy``: the union of the device's kernel, memcpy and memset intervals
  in that window; ``wall - busy`` is the time the device waited for the
  host, the gap a faster host loop closes. Copies from pinned host memory
  are left out of both: they are a read-ahead's batches for later steps
  (``runtime.data_pipeline.to_device``), copied on a side stream beside
  the kernels, so they fill no gap of the step's own work;
- ``launches``: kernel launches (``cudaLaunchKernel``, ``cuLaunchKernel``,
  their ``Ex`` forms, ``cudaGraphLaunch``);
- ``copies``: memcpy by direction (``HtoD``, ``DtoH``, ``DtoD``);
- ``waits``: CUDA runtime calls inside the span that block their thread
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, synchronous ``cudaMemcpy``) on the thread that
  ran the steps, and apart from them ``waits_elsewhere``, those of other
  threads: a read-ahead worker's wait for its copy on the side stream
  holds up no kernel launch, an executor queue thread's may (``None``, and
  every wait in ``waits``, where no launch carries the stepping thread's
  id: the runtime calls were numbered otherwise);
- ``sites``: where each synchronizing op torch warned about was called:
  the innermost Python frame outside torch and this module, and the
  thread (a read-ahead worker's or network thread's wait holds up no
  kernel launch), with counts.

CUPTI records device activity and CUDA runtime calls from every thread, so
``busy`` and ``launches`` include our executor's queue threads.
A sync warning reaches Python in the thread that ran the op, so ``sites``
sees those threads too; autograd's own CUDA thread (backward) gathers its
warnings and torch replays them in the thread that called backward, when
it returns, so a sync inside backward counts at that call. ``torch.profiler``'s op
events (``aten::...``) come only from the thread that started it, so
nothing here counts them. Without CUDA only ``wall`` is measured.
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
import threading
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

SPAN = "bench.profiled_steps"
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaGraphLaunch"})
WAITS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
SYNC_WARNING = "synchronizing CUDA operation"
_AHEAD_COPY = "Memcpy HtoD (Pinned -> Device)"  # a read-ahead's copy of a later step's batch (see ``busy``)
_VERSION = re.compile(r"_v\d+$")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP = (_TORCH_DIR, os.path.abspath(__file__), os.path.dirname(warnings.__file__) + os.sep + "warnings.py")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Event:
    """One profiler event: ``on_device`` for kernels, memcpy and memset; ``annotation`` for ``record_function``."""
    name: str
    on_device: bool
    start_ns: int
    dur_ns: int
    annotation: bool = False
    thread: int = 0  # the host thread's system id (kineto's ``device_resource_id`` of a host event)


@dataclass
class StepProfile:
    """Per-step figures of ``profile_steps`` (times in ms; ``busy``, ``launches``, ``copies``, ``waits`` None
    without device activity)."""
    steps: int
    wall_ms: float
    busy_ms: float | None = None
    launches: float | None = None
    copies: dict = field(default_factory=dict)
    waits: float | None = None
    sites: Counter = field(default_factory=Counter)
    waits_elsewhere: float | None = None

    def lines(self, label: str) -> list:
        """Printable lines: the figures per step, then each sync site with its count over all steps."""
        head = f"  {label:6s} profile of {self.steps} steps: {self.wall_ms:.2f} ms/step"
        if self.busy_ms is None:
            head += ", no device activity recorded"
        else:
            share = self.busy_ms / self.wall_ms if self.wall_ms > 0 else 0.0
            copies = " ".join(f"{self.copies.get(k, 0):g} {k}" for k in ("HtoD", "DtoH", "DtoD"))
            head += (f", device busy {self.busy_ms:.2f} ms ({share:.0%}), {self.launches:g} launches, "
                     f"copies {copies}, blocking calls {self.waits:g}")
            if self.waits_elsewhere is not None:
                head += f" (other threads {self.waits_elsewhere:g})"
        out = [head]
        out += [f"    sync x{n} at {site}" for site, n in self.sites.most_common()]
        return out


def _union_ns(intervals: list) -> int:
    """Total length of the union of ``(start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def reduce(events: list, steps: int, sites: Counter | None = None) -> StepProfile:
    """``StepProfile`` of ``events`` (``Event``s, one ``SPAN`` annotation among them) over ``steps`` steps."""
    spans = [e for e in events if e.annotation and not e.on_device and e.name == SPAN]
    if len(spans) != 1:
        raise ValueError(f"expected one host {SPAN!r} span among the events, found {len(spans)}")
    lo, hi = spans[0].start_ns, spans[0].start_ns + spans[0].dur_ns
    # A ``record_function`` region (ours, or torch's own such as an optimizer's step) also shows on the
    # device as a span of its name: a region, not work, whether or not kineto flags it as an annotation.
    marks = {e.name for e in events if e.annotation and not e.on_device}
    device = [e for e in events if e.on_device and not e.annotation and e.name not in marks
              and e.start_ns + e.dur_ns > lo]
    host = [e for e in events if not e.on_device and lo <= e.start_ns <= hi]
    sites = Counter(sites or {})
    if not device:
        return StepProfile(steps, (hi - lo) / 1e6 / steps, sites=sites)
    work = [e for e in device if not e.name.startswith(_AHEAD_COPY)]
    end = max([hi] + [e.start_ns + e.dur_ns for e in work])
    busy = _union_ns([(max(e.start_ns, lo), e.start_ns + e.dur_ns) for e in work])
    copies = Counter()
    for e in device:
        for kind in ("HtoD", "DtoH", "DtoD"):
            if e.name.startswith(f"Memcpy {kind}"):
                copies[kind] += 1
    api = [(_VERSION.sub("", e.name), e.thread) for e in host]  # CUPTI may name a call by its version: cudaX_v11060
    waits = [t for a, t in api if a in WAITS]
    # The stepping thread launches kernels; where none of the launches carries its id, the runtime calls
    # are numbered otherwise than the span, and the waits are not told apart.
    told = any(a in LAUNCHES and t == spans[0].thread for a, t in api)
    here = sum(t == spans[0].thread for t in waits) if told else len(waits)
    return StepProfile(steps, (end - lo) / 1e6 / steps, busy / 1e6 / steps,
                       sum(a in LAUNCHES for a, _ in api) / steps, {k: v / steps for k, v in copies.items()},
                       here / steps, sites, (len(waits) - here) / steps if told else None)


def _events(prof) -> list:
    """``Event``s of a finished ``torch.profiler.profile`` (the kineto events; torch 2.11 and later)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        out.append(Event(e.name(), e.device_type() != torch.autograd.DeviceType.CPU, e.start_ns(),
                         e.duration_ns(), bool(e.is_user_annotation()), int(e.device_resource_id())))
    return out


def _site(stack) -> str:
    """``path:line (function)`` of the innermost frame outside torch, ``warnings`` and this module."""
    for frame in reversed(stack):
        if not frame.filename.startswith(_SKIP):
            path = frame.filename
            path = path[len(_ROOT):] if path.startswith(_ROOT) else os.path.basename(path)
            return f"{path}:{frame.lineno} ({frame.name})"
    return "torch"


@contextmanager
def sync_sites():
    """A ``Counter`` of the call sites (``path:line (function) on thread NAME``) of synchronizing CUDA ops run
    inside the block, from any thread.

    Turns on ``torch.cuda.set_sync_debug_mode("warn")`` where CUDA is initialized and takes torch's warnings
    (``SYNC_WARNING``) from ``warnings.showwarning`` for the block; other warnings pass on as before.
    """
    sites, lock = Counter(), threading.Lock()
    with warnings.catch_warnings():  # restores the filters and showwarning after the block
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                site = f"{_site(traceback.extract_stack()[:-1])} on thread {threading.current_thread().name}"
                with lock:
                    sites[site] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        mode = torch.cuda.get_sync_debug_mode() if cuda else None
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)


def profile_steps(step, indices, device: str, trace: str | None = None) -> StepProfile:
    """Run ``step(i)`` for ``i`` in ``indices`` under the profiler and the sync probe; their ``StepProfile``.

    ``device``: ``"cuda"`` (device activity, then ``torch.cuda.synchronize`` inside the profile) or ``"cpu"``.
    ``trace``: where to write the Chrome trace, gzipped (``.json.gz``), or None.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    indices = list(indices)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        with sync_sites() as sites:
            with record_function(SPAN):
                for i in indices:
                    step(i)
        if device == "cuda":
            torch.cuda.synchronize()
    if trace is not None:
        plain = trace.removesuffix(".gz")
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(plain + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)
    return reduce(_events(prof), len(indices), sites)
