"""Training jobs on the shared rank pool: each rank's side of ``python train.py``, without spawning it.

A ``train.py`` run spawns its ranks, and every rank imports torch and the
toolkit before doing any work (seconds of CPU per rank). Layout parity and
resume only need what runs on the ranks, so they compose the config as
``train.py`` does (Hydra, validated against the recipe), then call the same
``toolkit.trainer.train`` on the reusable pool of local gloo ranks
(``toolkit.rank_pool``). ``test_train_cli.py`` keeps the command line's own
path: Hydra's parsing, errors before any process starts, the launcher, a
sweep and the 16-process run.
"""
from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from toolkit.config import compose, save_resolved_config, validate
from toolkit.rank_pool import get_pool


def _rank_train(container: dict):
    from recipes.registry import get
    from toolkit.trainer import train

    cfg = OmegaConf.create(container)
    return train(cfg, get(cfg.recipe.name))


def train_pooled(overrides: list, run_dir, cache: str, timeout: float = 900.0) -> list:
    """Run the job ``overrides`` composes with its run directory ``run_dir``; returns its per-step losses."""
    from recipes.registry import get

    cfg = compose([*overrides, f"data.cache_dir={cache}"], run_dir=str(run_dir))
    layout = validate(cfg, get(cfg.recipe.name))
    save_resolved_config(cfg, run_dir)  # as train.py does (generate.py and resume read it)
    get_pool(layout.world_size).run(_rank_train, OmegaConf.to_container(cfg, resolve=True), call_timeout=timeout)
    return losses(run_dir)


def one_process_run(tmp_path_factory, cache: str, name: str, overrides: list) -> tuple:
    """``(run directory, per-step losses)`` of the job ``overrides`` on one process, in a fresh directory named
    ``name`` (it ends with a checkpoint): a test module's reference run."""
    run = tmp_path_factory.mktemp(name)
    return run, train_pooled([*overrides, "parallel=single"], run, cache)


def losses(run_dir) -> list:
    """The ``loss`` of every training row of ``<run_dir>/metrics.jsonl``."""
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_losses(got: list, want: list, *context) -> None:
    """Every step's loss of ``got`` is ``want``'s within 1e-5 (relative): a layout trains as the reference does."""
    assert len(got) == len(want), (context, got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (context, got, want)


def refusal(overrides: list, run_dir) -> str:
    """The ``ConfigError`` that validating the job ``overrides`` composes raises, before any process starts."""
    import pytest

    from recipes.registry import get
    from toolkit.config import ConfigError

    cfg = compose(overrides, run_dir=str(run_dir))
    with pytest.raises(ConfigError) as info:
        validate(cfg, get(cfg.recipe.name), world_size=None)
    return str(info.value)
