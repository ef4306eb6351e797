"""Timelines: every action's start and end per rank and thread, as Chrome-trace JSON.

The file opens in Perfetto / chrome://tracing; ``scripts/plot_trace.py``
renders it as a PNG.
"""
from __future__ import annotations

import json
import time


class Trace:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.t0 = time.perf_counter()
        self.wall0 = time.time()  # the same instant on the wall clock, to line up local ranks' traces
        self.events: list = []  # (name, thread index, start s, end s, piece)
        self.threads: dict = {}  # thread index -> queue name

    def record(self, name: str, thread: int, start: float, end: float, piece: int) -> None:
        self.events.append((name, thread, start, end, piece))

    def chrome_events(self) -> list:
        out = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        for tid, name in sorted(self.threads.items()):
            out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
        for name, tid, start, end, piece in self.events:
            out.append({
                "name": name, "ph": "X", "pid": self.rank, "tid": tid,
                "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6, "args": {"piece": piece},
            })
        return out

    def wall_events(self) -> list:
        """``(name, start, end, piece)`` with wall-clock seconds, comparable across processes of one machine."""
        shift = self.wall0 - self.t0
        return [(name, start + shift, end + shift, piece) for name, _, start, end, piece in self.events]

    def save(self, path: str, more_events=()) -> str:
        """Write this trace (plus other ranks' ``chrome_events()``) as one Chrome-trace file."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_events() + list(more_events), "displayTimeUnit": "ms"}, f)
        return path
