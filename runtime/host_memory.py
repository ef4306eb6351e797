"""Host memory freed during a step stays with the process for the next one (glibc's malloc).

A training step allocates and frees the same host buffers every step
(activations, logits, gradient buckets, the optimizer's temporaries). With
glibc's defaults a freed block above the mmap threshold goes back to the
kernel at once, and a heap whose free top passes the trim threshold is
shrunk; the next step's allocation of the same size then takes fresh pages,
and every first touch of a page is a page fault the kernel serves by
zeroing it. Measured on this project's dp2 GPT-2 step (``bench_gpt.py``'s
pair, 2 ranks, gloo): 8-28 thousand minor faults per step on each rank,
and the kernels that write big fresh outputs (``mm``, ``_log_softmax`` and
its backward, ``copy_``) 13-77% slower than in a step without faults (self
CPU under ``torch.profiler``, steps on the main thread).

``keep_freed_host_memory()`` makes glibc keep what it frees, as a caching
allocator does for device memory: blocks up to 32 MiB (glibc's largest
mmap threshold) come from the heap instead of their own mapping, the heaps
are not trimmed (below 2 GiB of free top), and every thread allocates from
one arena. The last matters because the runtime computes on worker
threads: a thread's own arena grows in 64 MiB heaps and glibc unmaps a
heap (other than the first) as soon as it is empty, so a step whose peak
passes 64 MiB faulted its logits back in every step whatever the
thresholds (measured: 8-16 thousand faults per step left after the
thresholds alone, 0-4 thousand with one arena). The arena limit only holds
if it is set before a second thread first allocates, so the rank launchers
(``toolkit.launcher``, ``toolkit.rank_pool``) and ``train.py`` call this
first thing; later calls still set the thresholds.

The process's resident memory then stays at its peak instead of following
every step's rise and fall (what the heap holds in use, ``mallinfo2``, is
unchanged). Process-wide, once; nothing happens where the C library is
not glibc (``mallopt`` absent). Not an allocator of
our own, nor jemalloc/tcmalloc: those need ``LD_PRELOAD`` before the
process starts, which a rank spawned by torchrun or our launcher does not
get from the training code.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: a free heap top this large is never reached

_done = [False]


def keep_freed_host_memory() -> bool:
    """Tell glibc to keep freed host memory for reuse (module docstring); True if it took effect."""
    if _done[0]:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl builds without it, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done[0] = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
                and bool(mallopt(M_ARENA_MAX, 1)))
    return _done[0]
