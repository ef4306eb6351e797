"""``python generate.py run=<dir>`` samples from a run's last checkpoint with its tokenizer."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.cli.test_train_cli import ROOT


def test_generate_continues_a_prompt_from_a_trained_run(single_run):
    run, _ = single_run  # the layout tests' one-process reference run; it ends with a checkpoint
    gen = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), f"run={run}", "prompt=def f(x):",
                          "tokens=16", "seed=1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("def f(x):") and len(gen.stdout) > len("def f(x):")
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "prompt=x"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "run=<run dir> is required" in bad.stderr
