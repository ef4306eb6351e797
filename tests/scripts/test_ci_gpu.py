""".ci/gpu on a machine without a GPU: each step runs, its output kept, a failed step stopping none after it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .running import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_each_chosen_step_runs_and_the_exit_status_counts_the_failed_ones(tmp_path):
    out = subprocess.run([os.path.join(ROOT, ".ci", "gpu"), str(tmp_path), "gpu_check", "cuda_tests"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 1, out.stdout + out.stderr  # gpu_check has no GPU here; the CUDA tests all skip
    assert sorted(os.listdir(tmp_path)) == ["cuda_tests.txt", "gpu_check.txt"]
    check = (tmp_path / "gpu_check.txt").read_text()
    assert "no CUDA device here" in check and check.rstrip().endswith("== gpu_check: exit 2")
    tests = (tmp_path / "cuda_tests.txt").read_text()
    assert " skipped" in tests and tests.rstrip().endswith("== cuda_tests: exit 0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_nccl_step_tries_again_without_cumem_and_counts_one_failure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_CUMEM_ENABLE"}
    out = subprocess.run([os.path.join(ROOT, ".ci", "gpu"), str(tmp_path), "nccl"],
                         capture_output=True, text=True, timeout=120, env={**env, "PYTHON": sys.executable})
    assert out.returncode == 1, out.stdout + out.stderr
    text = (tmp_path / "nccl.txt").read_text()
    assert text.count("nccl: no CUDA device here") == 2 and "again with NCCL_CUMEM_ENABLE=0" in text, text
