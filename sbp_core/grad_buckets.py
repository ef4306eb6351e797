"""Gradient buckets: gradient boxing that overlaps backward, as DDP's buckets do.

``GradBuckets(leaves, targets)`` groups leaves (parameters, or ZeRO's grad
leaves) in *reverse* order — backward produces the last layers' gradients
first — into buckets of about ``bucket_bytes`` of local gradient (the first
bucket at most ``first_bucket_bytes``, DDP's 1 MiB, so communication starts
early). While armed, each leaf's post-accumulate-grad hook marks it ready;
as soon as every leaf of the next bucket in order is ready, that bucket's
boxing to the targets starts asynchronously
(``boxing.coalesced.box_many_async``: one collective per kind of step, e.g.
``P -> B`` all-reduce for data parallel, ``P -> S(d)`` reduce-scatter for
ZeRO) and backward goes on computing earlier layers; the buckets started
before it advance first (each waits for its all-reduce's reduce-scatter and
starts the all-gather, and where gradients take several rounds of steps,
waits for the round and starts the next: waiting, not polling, because
collectives must start in one order on every rank). When backward ends (an autograd-engine callback),
buckets not yet started (some leaf got no gradient in this backward) start
with the leaves that are ready, every bucket is waited for, and
``on_done(leaf, boxed)`` receives each boxed gradient (a ``GlobalTensor``
in the target layout, the grad's dtype). So ``backward()`` returns with
the gradients boxed, as when each was boxed on its own.

Armed: every backward outside ``defer_grad_boxing()`` (gradient
accumulation defers all but the last micro-batch, whose backward then
boxes the accumulated sum), or every backward with ``always=True`` (ZeRO-2
reduces each micro-batch's gradient).

Exact: a bucket's collectives are ``box_many``'s, so every element is summed
in one order whatever the bucket size, the same for data parallel's
all-reduce and ZeRO's reduce-scatter (see
``collectives.all_reduce_packed_start``); that holds on gloo, where the suite
checks it. NCCL picks its algorithm and channels by message size, so on GPUs
a bucket size may change an element's rounding, the same on every rank. Sparse
row gradients (``SparseGlobalTensor``) are boxed alone, synchronously, to
the layout their table's rows allow, when their bucket starts. Every rank
must run the same backward (same graph): buckets start in bucket order.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from .boxing.coalesced import box_many_async
from .global_tensor import GlobalTensor
from .sparse import SparseGlobalTensor, sparse_sbp_for

BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: small, so the first collective starts early

# Process-wide, not per thread: CUDA runs backward hooks on the autograd
# engine's device threads, not on the thread that called backward.
_deferred = [0]


@contextmanager
def defer_grad_boxing():
    """Inside (any thread of this process), backward leaves gradients in the layout they arrive in."""
    _deferred[0] += 1
    try:
        yield
    finally:
        _deferred[0] -= 1


def _nbytes(leaf) -> int:
    local = leaf._local if isinstance(leaf, GlobalTensor) else leaf
    return local.numel() * local.element_size()


class GradBuckets:
    """Boxes ``leaves``' gradients to ``targets`` (one N-d SBP each) in buckets, overlapping backward.

    ``on_done(leaf, boxed)`` is called at the end of each armed backward for
    every leaf whose gradient was boxed (``boxed`` may be ``leaf.grad``
    itself when it already had the target layout). Leaves are held weakly.
    """

    def __init__(self, leaves, targets, on_done, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES, always: bool = False):
        if bucket_bytes <= 0 or first_bucket_bytes <= 0:
            raise ValueError(f"bucket sizes must be positive bytes, got bucket_bytes={bucket_bytes}, "
                             f"first_bucket_bytes={first_bucket_bytes}")
        self.on_done, self.always = on_done, always
        self.buckets: list = []  # [[weakref to leaf]]
        self._where: dict = {}  # id(leaf) -> (bucket index, target sbp, place in the bucket)
        size, cap = 0, first_bucket_bytes
        for leaf, target in reversed(list(zip(leaves, targets))):
            n = _nbytes(leaf)
            if not self.buckets or (size and size + n > cap):
                if self.buckets:
                    cap = bucket_bytes
                self.buckets.append([])
                size = 0
            self._where[id(leaf)] = (len(self.buckets) - 1, target, len(self.buckets[-1]))
            self.buckets[-1].append(weakref.ref(leaf))
            size += n
            leaf.register_post_accumulate_grad_hook(self._ready)
        self.reset()

    def reset(self) -> None:
        """Start afresh: also what forgets a backward that raised (autograd ran no end-of-backward
        callback for it; its gradients' boxings are waited for and dropped)."""
        for pending, _, _ in getattr(self, "_started", ()):
            pending.wait()
        self._ready_in = [[] for _ in self.buckets]  # per bucket: (leaf, target) whose gradient is in
        self._next = 0  # the next bucket to start
        self._started: list = []  # (pending boxing, [(leaf, target)] boxed by it, [(leaf, boxed)] done now)
        self._task = None  # the autograd graph task whose end-of-backward callback is queued

    def _ready(self, leaf) -> None:
        if _deferred[0] and not self.always:
            return
        b, target, _ = self._where[id(leaf)]
        task = torch._C._current_graph_task_id()
        if task != self._task:  # this backward's first gradient; a backward that raised left its state: drop it
            self.reset()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._ready_in[b].append((leaf, target))
        while self._next < len(self.buckets) and len(self._ready_in[self._next]) == len(self.buckets[self._next]):
            self._start(self._next)

    @torch.no_grad()
    def _start(self, b: int) -> None:
        for pending, _, _ in self._started:
            pending.advance()
        # In the bucket's own order, not the hooks': every rank packs its pieces alike, whatever order
        # autograd's threads hand the gradients in (a misaligned pack would sum unrelated pieces).
        ready = sorted(self._ready_in[b], key=lambda item: self._where[id(item[0])][2])
        self._ready_in[b] = []
        items, boxed, done = [], [], []
        for leaf, target in ready:
            grad = leaf.grad
            if isinstance(grad, SparseGlobalTensor):
                want = sparse_sbp_for(target)
                done.append((leaf, grad if grad.sbp == want else grad.to_global(sbp=want)))
            elif not isinstance(grad, GlobalTensor) or grad.sbp == target:
                done.append((leaf, grad))
            else:
                items.append((grad._local, grad.layout, grad.layout.with_sbp(target)))
                boxed.append(leaf)
        self._started.append((box_many_async(items), [(leaf, dst) for leaf, (_, _, dst) in zip(boxed, items)], done))
        self._next = b + 1

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        while self._next < len(self.buckets):
            self._start(self._next)
        started, self._started = self._started, []
        self.reset()
        for pending, boxed, done in started:
            for (leaf, dst), local in zip(boxed, pending.wait()):
                self.on_done(leaf, GlobalTensor(local, dst))
            for leaf, grad in done:
                if grad is not None:
                    self.on_done(leaf, grad)
