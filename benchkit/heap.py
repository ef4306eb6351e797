"""Heap memory for the benchmarks: bytes of C heap in use, and its peak sampled on a thread.

``heap_bytes()`` is glibc's ``mallinfo2`` (``uordblks + hblkhd``: every
thread's allocations, not distorted by freed pages as RSS is), or resident
bytes where ``mallinfo2`` is missing. ``HeapPeak`` samples it every
``every`` seconds between ``start()`` and ``stop()``.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _reader():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def heap():
            m = libc.mallinfo2()
            return m.uordblks + m.hblkhd

        heap()
        return heap
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return rss


heap_bytes = _reader()


class HeapPeak:
    """Samples ``heap_bytes()`` on a thread between ``start`` and ``stop``; ``stop`` returns the peak."""

    def __init__(self, every: float = 2e-4):
        self.every, self.peak, self.when, self._on, self._thread = every, 0, 0.0, False, None

    def _loop(self):
        while self._on:
            self._sample()
            time.sleep(self.every)

    def _sample(self):
        h = heap_bytes()
        if h > self.peak:
            self.peak, self.when = h, time.time()

    def start(self):
        self.peak, self.when, self._on = heap_bytes(), time.time(), True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._on = False
        self._thread.join()
        self._sample()
        return self.peak
