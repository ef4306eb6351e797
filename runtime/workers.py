"""Long-lived OS threads for the executor's queues, reused from one run to the next.

A training step is one ``executor.run``; starting its queue threads afresh
every step costs more than the thread's creation: a new thread starts with
cold per-thread allocator and BLAS state (glibc's arena caches, MKL's GEMM
buffers, ~12 MB per thread, which live until the thread exits), so its
first forward and backward fault those pages in again. Measured on gpt2-tiny
(4 micro-batches of 4 x 128 tokens, forward + backward + AdamW, one
intra-op thread, load ~20): 557 ms CPU and ~38k page faults per step on a
fresh thread per step, 522 ms and ~14k on one persistent thread, 521 ms and
~20k on the main thread (medians of 8).

So each queue name (``compute``, ``copy``, ``data``, ``network:<i>``) gets
a worker that waits for a job and runs it; ``start(name, job)`` hands
``job`` to an idle worker of that name (a new one when all are busy, e.g.
one still stuck in an action of a run that timed out, or two runs at once)
and the worker is idle again when ``job`` returns. Each job starts with
autograd enabled, as a new thread would (grad mode is per thread), and,
once CUDA is in use, on the CUDA device current where ``start`` was called:
the current device is per thread too, and a new thread's is GPU 0, so rank
3's step would otherwise allocate ``"cuda"`` tensors, streams and
``Placement.device()`` on GPU 0.
"""
from __future__ import annotations

import queue
import threading

import torch

_idle: dict = {}  # queue name -> [idle _Worker]
_lock = threading.Lock()


class _Worker(threading.Thread):
    def __init__(self, name: str):
        super().__init__(name=f"sbp-{name}", daemon=True)
        self.queue_name = name
        self.jobs = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job, done, device = self.jobs.get()
            torch.set_grad_enabled(True)
            if device is not None:
                torch.cuda.set_device(device)
            try:
                job()
            except BaseException:
                done.set()
                raise  # this worker ends here and is never handed a job again
            with _lock:  # idle before ``done``: the caller's next run finds this worker
                _idle.setdefault(self.queue_name, []).append(self)
            done.set()


def start(name: str, job) -> threading.Event:
    """Run ``job()`` on a worker thread of queue ``name``; the returned event is set when it returns."""
    with _lock:
        free = _idle.get(name)
        worker = free.pop() if free else None
    if worker is None:
        worker = _Worker(name)
        worker.start()
    done = threading.Event()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    worker.jobs.put((job, done, device))
    return done
