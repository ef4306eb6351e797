"""scripts/gpu_check.py: exits 2 without a GPU; its check itself (ours against a plain loop) runs on CPU."""
from __future__ import annotations

import pytest
import torch

from .running import run_main, run_script


def _run(args, tmp_path):
    return run_script("gpu_check.py", args, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    out = _run([], tmp_path)
    assert out.returncode == 2 and "no CUDA device" in out.stdout, out.stdout + out.stderr


def test_every_recipe_matches_a_plain_loop_on_cpu(tmp_path, monkeypatch, capsys):
    code, stdout, stderr = run_main("gpu_check", ["--device", "cpu", "--tiny", "--steps", "4"], tmp_path, monkeypatch,
                                    capsys)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("gpu check: gpt2 ok, insightface ok, wide_deep ok, llama ok; mfu "), last


def test_a_recipe_whose_check_raises_fails_and_the_next_ones_still_run(monkeypatch, capsys):
    import scripts.gpu_check as gpu_check

    def check(name, overrides, device, steps, compare, root):
        if name == "insightface":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"recipe": name, "precision": "fp32", "ours": [2.0], "plain": [2.0], "diff": 0.0, "tol": 1e-4,
                "ok": True, "unit": "samples", "ours_rate": 10.0, "plain_rate": 10.0, "mfu": None}

    monkeypatch.setattr(gpu_check, "check", check)
    assert gpu_check.main(["--device", "cpu", "--tiny"]) == 1
    out = capsys.readouterr()
    assert "RuntimeError: CUDA error: an illegal memory access" in out.err
    assert "insightface  FAIL: RuntimeError: CUDA error" in out.out
    assert out.out.strip().splitlines()[-1] == "gpu check: gpt2 ok, insightface FAIL, wide_deep ok, llama ok; mfu -"
