"""``python generate.py run=<dir>`` samples from a run's last checkpoint with its tokenizer."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_generate_names_a_missing_run_directory_in_one_line(tmp_path):
    missing = tmp_path / "nonexistent"
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), f"run={missing}"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0
    assert bad.stderr.strip() == f"generate.py: run={missing}: no such directory (give a run directory train.py wrote)"


def test_generate_refuses_another_recipes_run_before_loading_it(tmp_path, monkeypatch):
    import generate
    from toolkit import checkpoint as ckpt
    from toolkit.config import compose
    from toolkit.config.run_config import save_resolved_config

    run = tmp_path / "insightface_run"
    save_resolved_config(compose(["recipe=insightface", "logger=none"], run_dir=str(run)), run)
    monkeypatch.setattr(ckpt, "latest", lambda root: pytest.fail("looked for a checkpoint"))
    with pytest.raises(SystemExit) as exit_:
        generate.main([f"run={run}"])
    assert exit_.value.code == (f"generate.py: run={run} was trained with recipe=insightface; generate.py samples "
                                "from language-model runs only (recipe=gpt2 or llama)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no config.yaml there"):
        generate.main([f"run={tmp_path / 'empty'}"])
