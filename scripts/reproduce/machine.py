"""The machine a figure was measured on: CPU, cores, memory, accelerator, torch, and the load around the run.

Timings on a shared machine mean little without the load next to them, so
``Machine.now()`` reads the 1/5/15-minute load averages when a figure
starts and ``finish()`` when it ends; ``describe()`` is the line every
report and plot carries.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return None


def _accelerator() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name(0)}"
    return "no GPU"


def _load() -> tuple:
    return tuple(round(x, 2) for x in os.getloadavg())


@dataclass
class Machine:
    cpu: str
    cores: int
    memory_gib: float | None
    accelerator: str
    torch: str
    python: str
    load_start: tuple
    load_end: tuple | None = None

    @classmethod
    def now(cls) -> "Machine":
        import torch

        return cls(_cpu_model(), os.cpu_count() or 1, _memory_gib(), _accelerator(), torch.__version__,
                   platform.python_version(), _load())

    def finish(self) -> "Machine":
        self.load_end = _load()
        return self

    def describe(self) -> str:
        mem = f", {self.memory_gib:.0f} GiB" if self.memory_gib else ""
        load = f"load average (1/5/15 min) {'/'.join(map(str, self.load_start))} at start"
        if self.load_end is not None:
            load += f", {'/'.join(map(str, self.load_end))} at end"
        return (f"{self.cpu}, {self.cores} cores{mem}, {self.accelerator}; torch {self.torch}, "
                f"Python {self.python}; {load}")
