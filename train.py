"""Train a recipe: ``python train.py recipe=gpt2 parallel=dp2_tp4_pp2``.

Hydra composes ``configs/`` (``recipe=``, ``model=``, ``parallel=`` any ``dpX_tpY_ppZ``
name or ``parallel.dp=..`` or ``auto`` (search the plan first, ``toolkit.search``),
``data=``, ``trainer.*``, ``logger=none``); the
config is validated before any process starts; without torchrun or Slurm
this spawns dp*cp*tp*pp local processes (gloo on CPU, NCCL with a GPU each).
The run directory (``hydra.run.dir``) gets ``config.yaml`` and
``metrics.jsonl``.
"""
from __future__ import annotations

from runtime.host_memory import keep_freed_host_memory

keep_freed_host_memory()  # before torch starts threads: torchrun's or a one-process run's ranks get one arena too

import functools  # noqa: E402

import hydra  # noqa: E402

from toolkit.config import CONFIG_DIR, save_resolved_config, validate  # noqa: E402  registers the schema and layouts
from toolkit.launcher import launch  # noqa: E402


def run(cfg, layout=None):
    """On every rank: the job ``cfg`` describes, laid out as ``layout`` (validated once, before the ranks)."""
    from recipes.registry import get
    from toolkit.trainer import train

    return train(cfg, get(cfg.recipe.name), layout)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def main(cfg):
    from recipes.registry import get

    recipe = get(cfg.recipe.name)
    if cfg.parallel.auto:  # search (or load) the plan here, before any rank exists
        from toolkit.search.auto import resolve

        run_dir = str(cfg.run_dir)
        cfg = resolve(cfg, recipe)
        cfg.run_dir = run_dir
    layout = validate(cfg, recipe)
    save_resolved_config(cfg, cfg.run_dir)
    return launch(functools.partial(run, layout=layout), cfg, layout.world_size)


if __name__ == "__main__":
    main()
