"""docs/writing-a-recipe.md works as written: its files, its configs and its two commands.

The page's fenced blocks introduced by "File `<path>`:" are written to a
fresh directory under those paths; its ``bash`` block's commands run there,
with ``train.py`` from this checkout (``pip install -e .`` in a user's
project). The one-process run and the dp2 x tp2 run must both train, and
agree step by step (1e-5 relative: float32 summation order).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "writing-a-recipe.md"


def _blocks(kind: str) -> list:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def _losses(run_dir: pathlib.Path) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_the_tutorial_recipe_trains_alone_and_under_dp2_tp2_alike(tmp_path):
    written = []
    for path, body in re.findall(r"File `([\w/.-]+)`:\n\n```(?:python|yaml)\n(.*?)```", PAGE.read_text(), re.S):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
        written.append(path)
    (tmp_path / "my_recipes" / "__init__.py").write_text("")
    assert sorted(written) == ["my_configs/data/blobs.yaml", "my_configs/model/blobs.yaml",
                               "my_configs/recipe/blobs.yaml", "my_recipes/blobs.py"]
    (commands,) = [b for b in _blocks("bash") if "recipe=blobs" in b]
    runs = []
    for i, line in enumerate(commands.strip().splitlines()):
        words = shlex.split(line)
        env = dict(os.environ, SBP_TIMEOUT="120", HYDRA_FULL_ERROR="1")
        while "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        assert words[:2] == ["python", "train.py"], line
        run_dir = tmp_path / f"run{i}"
        out = subprocess.run([sys.executable, str(ROOT / "train.py"), *words[2:], f"hydra.run.dir={run_dir}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(_losses(run_dir))
    single, parallel = runs
    assert len(single) >= 3 and single[-1] < single[0], single
    assert len(parallel) == len(single)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(parallel, single)), (parallel, single)
