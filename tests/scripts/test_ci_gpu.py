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
def test_without_a_gpu_the_nccl_step_says_so_once_and_fails(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_CUMEM_ENABLE"}
    out = subprocess.run([os.path.join(ROOT, ".ci", "gpu"), str(tmp_path), "nccl"],
                         capture_output=True, text=True, timeout=120, env={**env, "PYTHON": sys.executable})
    assert out.returncode == 1, out.stdout + out.stderr
    text = (tmp_path / "nccl.txt").read_text()
    assert text.count("nccl: no CUDA device here") == 1 and "again" not in text, text


STUB = """#!/usr/bin/env bash
# python3 as a machine whose NCCL starts only with NCCL_CUMEM_ENABLE=0 sees it
if [ "$1" = scripts/nccl_check.py ]; then
    if [ "${NCCL_CUMEM_ENABLE:-}" = 0 ]; then echo "nccl: ok"; exit 0; fi
    echo "nccl: failed: NCCL error: unhandled system error"; exit 1
fi
echo "NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-unset}"
"""


def test_where_nccl_starts_only_without_cumem_the_retry_sets_that_for_the_later_steps(tmp_path):
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NCCL_CUMEM_ENABLE"}
    out_dir = tmp_path / "out"
    out = subprocess.run([os.path.join(ROOT, ".ci", "gpu"), str(out_dir), "nccl", "gpu_check"],
                         capture_output=True, text=True, timeout=120, env={**env, "PYTHON": str(stub)})
    assert out.returncode == 0, out.stdout + out.stderr  # the retry's success cancels the first try's failure
    text = (out_dir / "nccl.txt").read_text()
    assert "nccl: failed" in text and "again with NCCL_CUMEM_ENABLE=0" in text and "nccl: ok" in text, text
    assert "NCCL_CUMEM_ENABLE=0" in (out_dir / "gpu_check.txt").read_text()
