"""scripts/bench_read_ahead.py: every way loads load's batches (checked by the script), and the table prints."""
from __future__ import annotations

import re

from .running import run_script


def test_read_ahead_against_dataloader_prints_its_table(tmp_path):
    out = run_script("bench_read_ahead.py", ["--cases", "wide_deep", "--workers", "2", "--batches", "3",
                                             "--rounds", "2"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    ways = [line.split()[:-1] for line in lines[-4:-1]]
    assert ways == [["in", "step"], ["ahead", "2"], ["DataLoader", "2"]], lines
    assert re.fullmatch(r"  ahead 2 / DataLoader 2 throughput \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", lines[-1]), lines[-1]
