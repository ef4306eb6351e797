"""scripts/bench_data_feed.py: every way feeds load's batches (checked by the script), and the table prints."""
from __future__ import annotations

import re

from .running import run_script


def test_each_way_feeds_the_step_and_the_table_prints(tmp_path):
    out = run_script("bench_data_feed.py", ["--cases", "wide_deep_512", "--steps", "2", "--rounds", "2"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"  preloaded +\d+\.\d\d ms", lines[-5]), lines[-5]
    for way, line in zip(["in step", "ahead 1", "DataLoader 1"], lines[-4:-1]):
        assert re.fullmatch(rf"  {way} +\d+\.\d\d ms +[+-]\d+\.\d\d ms  \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", line), line
    assert re.fullmatch(r"data feed: wide_deep_512 ahead \d+\.\d\dx, DataLoader \d+\.\d\dx, in step \d+\.\d\dx",
                        lines[-1]), lines[-1]
