"""scripts/bench_experts.py: our expert-parallel Mixtral and transformers' under DDP train alike, and the table prints."""
from __future__ import annotations

import re

from .running import run_main, run_script


def test_ours_and_transformers_agree_and_ours_holds_and_sends_less(tmp_path, monkeypatch, capsys):
    """No choice dropped: both ways compute the same losses (else the script exits 1). Each rank holds half the
    experts, so its weights, gradients and AdamW moments are below the replicated peer's, and the all-to-alls
    of the tokens send less than all-reducing every expert's gradient (here 0.64x and 0.52x)."""
    code, stdout, stderr = run_main(
        "bench_experts", ["--layers", "1", "--hidden", "64", "--vocab", "512", "--seq", "32", "--batch", "4",
                          "--steps", "2", "--warmup", "1"], tmp_path, monkeypatch, capsys)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[-4:-2]] == ["ours", "transformers"], lines
    assert "all_to_all" in lines[-2] and "agree" in lines[-2], lines[-2]
    last = re.fullmatch(r"experts: state per rank (\d+\.\d\d)x, sent per step (\d+\.\d\d)x, throughput "
                        r"\d+\.\d\dx \(paired, \d+\.\d\d-\d+\.\d\d\)", lines[-1])
    assert last, lines[-1]
    assert float(last[1]) < 1 and float(last[2]) < 1, lines[-1]


def test_experts_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    out = run_script("bench_experts.py", ["--dp", "2", "--experts", "3"], tmp_path)
    assert out.returncode == 2 and "--experts 3 and --batch 8 must divide by --dp 2" in out.stderr
