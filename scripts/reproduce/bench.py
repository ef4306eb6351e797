"""Run one of ``scripts/bench_*.py`` as a child process and read back the rows it printed, as JSON.

Each benchmark script keeps its own printed table and last line; its
``--json PATH`` option writes the same numbers for a figure to use. A
child process (rather than calling ``main`` in this one) keeps each
benchmark's process-wide settings (``torch.set_num_threads(1)``, rank
pools, allocator state) from leaking into the next figure. The child's
output is echoed live and kept in the figure's log.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchError(RuntimeError):
    """A benchmark script that ended without writing its JSON; the message names the command and exit status."""


class BenchRunner:
    """Runs benchmark scripts for one figure; ``commands`` lists what ran (for the report), ``log`` their output."""

    def __init__(self, log_path: str | None = None):
        self.commands: list[str] = []
        self.log_path = log_path
        if log_path:
            open(log_path, "w").close()

    def run(self, script: str, args: list) -> dict:
        """``python scripts/<script>.py <args> --json <tmp>``; the JSON it wrote (``exit_status`` added)."""
        path = os.path.join(SCRIPTS, f"{script}.py")
        if not os.path.isfile(path):
            raise BenchError(f"no benchmark script {path}")
        args = [str(a) for a in args]
        shown = shlex.join(["python", f"scripts/{script}.py"] + args)
        self.commands.append(shown)
        print(f"$ {shown}", flush=True)
        with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
            out = os.path.join(tmp, "rows.json")
            status = self._stream(shown, [sys.executable, path] + args + ["--json", out])
            if not os.path.isfile(out):
                raise BenchError(f"`{shown}` exited with status {status} without writing its rows"
                                 + (f"; its output is in {self.log_path}" if self.log_path else ""))
            with open(out) as f:
                data = json.load(f)
        data["exit_status"] = status
        return data

    def _stream(self, shown: str, cmd: list) -> int:
        log = open(self.log_path, "a") if self.log_path else None
        try:
            if log:
                log.write(f"$ {shown}\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if log:
                    log.write(line)
            return proc.wait()
        finally:
            if log:
                log.close()
