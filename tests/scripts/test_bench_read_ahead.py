"""scripts/bench_read_ahead.py: every way loads load's batches (checked by the script), and the table prints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_read_ahead_against_dataloader_prints_its_table(tmp_path):
    env = {**os.environ, "SBP_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_read_ahead.py"), "--cases", "wide_deep",
                          "--workers", "2", "--batches", "3", "--rounds", "2"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    ways = [line.split()[:-1] for line in lines[-4:-1]]
    assert ways == [["in", "step"], ["ahead", "2"], ["DataLoader", "2"]], lines
    assert re.fullmatch(r"  ahead 2 / DataLoader 2 throughput \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", lines[-1]), lines[-1]
