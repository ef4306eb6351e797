"""Micro-batches loaded ahead of the step that reads them, on worker threads: an accelerator's data side.

A step's data actors (``runtime.data_pipeline``) load each micro-batch inside
the step's run. On an accelerator the host queues a step's kernels and
returns before the device is done with them, so the next step's batches
could load while the device works; inside the run they start only when the
run does, and a batch that takes the host longer than the device's step
sets the pace: InsightFace's 128 JPEG faces take about 40 ms of one core
to decode, a plain loop's whole step on an H100 about 66 ms.

``ReadAhead(batches, pieces, workers)`` keeps micro-batches ``q .. q +
pieces`` loading on ``workers`` threads while the step reads ``q`` (a piece
``q`` is micro-batch ``q % accum`` of step ``q // accum``, the numbering of
``MicroBatches.read``); ``get(q)`` returns batch ``q`` (waiting for it if
it is still loading) and starts the next. A ``get`` outside the window (a
resumed run, an evaluation that starts again at step 0) drops what was
loading and starts from there, so any order of ``get`` returns exactly
``batches.load``'s batches. A load's exception is raised by the ``get`` of
its piece, not before. ``device`` (a CUDA device, where the batches go):
the worker also copies each batch there (``runtime.data_pipeline.to_device``:
pinned, copied on the side stream, and waited for on the worker), so a batch
that ``get`` returns is on the device already: the copy of a later step's
batches runs while the device computes this one, and taking a batch is a
lookup on the step's own thread (no copy actor, no thread hand-off; up to
``pieces + 1`` batches are held on the device). Each worker thread is bound
to that device first (``torch.cuda.set_device``, as DataLoader's pinning
thread is), else its first allocation would open a context on GPU 0 on every
rank. The workers are daemon threads: a load stuck in I/O never keeps a
process that failed from ending.

What runs where, and what a source must allow: a read-ahead calls ``read``
for one piece at a time (under its lock: reads are the file I/O, in order);
``decode`` and ``collate`` of different pieces run at once on different
threads, so they must be functions of their input, as every source here
makes them (the heavy work in them, JPEG decoding, parsing, hashing, runs
in PIL, numpy and torch kernels that release the GIL). Between those calls a
worker holds the GIL, and each time it takes it while the step's thread is
in a torch op, the step waits to get it back: a batch made in a few long
calls costs the step little, one made in a hundred short ones about its
whole load time (``scripts/bench_data_feed.py``).
``read`` itself must allow another thread's ``read`` at the same time: the
training batches' read-ahead keeps reading while an evaluation reads the
held-out rows of the same files, and a V-shaped pipeline's two data actors
each read ahead. The file readers here keep a handle per thread (Criteo TSV,
RecordIO) or publish their caches whole (Criteo parquet).

Threads, not ``torch.utils.data.DataLoader``'s worker processes: the step
asks for pieces by number, in any order, which a DataLoader serves only in
its sampler's order (a jump restarts its iterator and its workers' queues);
its workers hand batches over through shared memory (``/dev/shm``: 64 MB in
a default container, fewer bytes than four InsightFace batches of 128 x 3 x
112 x 112 float32); and each worker holds its own copy of the source.
"""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future, wait

import torch

from runtime.data_pipeline import copies_to, to_device


class _Workers:
    """``n`` daemon threads running submitted calls, each bound first to CUDA ``device`` (``None``: none).

    Not ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins its
    threads at exit, so one load stuck in I/O would keep a failed rank's
    process from ever ending. A dropped ``_Workers`` ends its threads (they
    hold its queue, never it)."""

    def __init__(self, n: int, device):
        self._jobs = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=_work, args=(self._jobs, device), name=f"sbp-read-ahead-{i}", daemon=True).start()
        self._stop = weakref.finalize(self, _stop, self._jobs, n)

    def submit(self, fn, *args) -> Future:
        done = Future()
        self._jobs.put((done, fn, args))
        return done

    def shutdown(self) -> None:
        self._stop()


def _stop(jobs, n: int) -> None:
    for _ in range(n):
        jobs.put(None)


def _work(jobs, device) -> None:
    if device is not None:
        torch.cuda.set_device(device)  # the current device is per thread: a new one's is GPU 0
    while True:
        job = jobs.get()
        if job is None:
            return
        done, fn, args = job
        del job  # hold nothing of a finished load while idle (its ReadAhead may be dropped)
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # raised by the get of its piece
                done.set_exception(e)
        del done, fn, args


class ReadAhead:
    """Batches ``q .. q + pieces`` of ``batches`` (a ``MicroBatches``) loading while piece ``q`` is read."""

    def __init__(self, batches, pieces: int, workers: int, device=None):
        for name, v in (("pieces", pieces), ("workers", workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReadAhead: {name} must be a positive int, got {v!r}")
        self.batches = batches.for_step(0)  # piece q of this one is the absolute piece q
        self.pieces, self.workers = pieces, workers
        self.device = None  # the CUDA device the batches are copied to, else None
        if copies_to(device):
            device = torch.device(device)
            self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._pool = None  # the worker threads, started by the first get
        self._loading = {}  # piece -> Future of its batch
        self._lock = threading.Lock()  # the window
        self._read_lock = threading.Lock()  # one source read at a time

    def _load(self, q: int):
        b = self.batches
        with self._read_lock:
            raw = b.read(q)
        return to_device(b.collate(q, b.decode(q, raw)), self.device)

    def get(self, q: int):
        """Batch ``q`` (``batches.load(q // accum, q % accum)``), with ``q + 1 .. q + pieces`` loading."""
        with self._lock:
            if self._pool is None:
                self._pool = _Workers(self.workers, self.device)
            for k in [k for k in self._loading if not q <= k <= q + self.pieces]:
                self._loading.pop(k).cancel()  # one already running finishes and is dropped
            for k in range(q, q + self.pieces + 1):
                if k not in self._loading:
                    self._loading[k] = self._pool.submit(self._load, k)
            loading = self._loading.pop(q)
        return loading.result()

    def settle(self) -> None:
        """Wait until every piece loading now is loaded or has failed (its ``get`` still raises): a timing
        that must not count this read-ahead's work beside another loop's steps (``scripts/bench_gpu.py``)
        ends with it."""
        with self._lock:
            loading = list(self._loading.values())
        wait(loading)

    def close(self) -> None:
        """Drop what is loading and let the worker threads end once their current load is done (a later
        ``get`` starts new ones)."""
        with self._lock:
            for f in self._loading.values():
                f.cancel()
            self._loading, pool, self._pool = {}, self._pool, None
        if pool is not None:
            pool.shutdown()
