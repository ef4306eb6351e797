"""scripts/bench_llama_tp.py: ours and DTensor (torchtitan's plan) train the same LLaMA alike, and the table prints."""
from __future__ import annotations

import re

import pytest

from .running import run_main, run_script


@pytest.mark.parametrize("options", [[], ["--sequence-parallel"]])
def test_ours_and_dtensor_agree_and_the_summary_prints(options, tmp_path, monkeypatch, capsys):
    """Both ways compute the same losses; ours issues no more collectives a step than torchtitan's plan, with
    the sequence split too (there each of LLaMA's separate projections would gather its input for itself
    without the plan's pins at the attention's and the MLP's input: 68 against 38 here)."""
    code, stdout, stderr = run_main(
        "bench_llama_tp", ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
                           "--seq", "16", "--batch", "4", "--steps", "2", "--warmup", "2", *options],
        tmp_path, monkeypatch, capsys)
    assert code == 0, stdout[-3000:] + stderr[-3000:]  # 1: the warm-up losses disagree
    lines = stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[-4:-2]] == ["ours", "dtensor"], lines
    last = re.fullmatch(r"llama tp: ours \d+\.\d\dx DTensor \(paired \d+\.\d\dx, \d+\.\d\d-\d+\.\d\d\); "
                        r"collectives (\d+) vs (\d+)", lines[-1])
    assert last, lines[-1]
    assert int(last[1]) <= int(last[2]), lines[-1]


def test_kv_heads_that_do_not_split_are_refused(tmp_path):
    out = run_script("bench_llama_tp.py", ["--tp", "2", "--kv-heads", "1"], tmp_path)
    assert out.returncode == 2 and "--kv-heads 1 must divide --heads 8 and divide by --tp 2" in out.stderr
