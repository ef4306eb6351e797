"""Configuration of a training job: Hydra config groups, typed schema, validation.

Importing this package registers, with Hydra, the typed root schema
(``sbp_schema``, see :mod:`toolkit.config.schema`) and the ``sbp-parallel://``
config source that turns any ``parallel=dpX_tpY_ppZ[_zeroK]`` choice into a
config (see :mod:`toolkit.config.parallel_source`). Both are named in
``configs/config.yaml``, so ``train.py`` imports this package before
``@hydra.main`` runs::

    import hydra
    from toolkit.config import CONFIG_DIR, validate

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
    def main(cfg):
        recipe = recipes.registry.get(cfg.recipe.name)
        layout = validate(cfg, recipe)  # ConfigError before any process starts
        ...

Public API: :func:`validate` -> :class:`JobLayout`, :class:`ConfigError`,
:class:`ConfigWarning`, :func:`parse_parallel_name`, :func:`parallel_name`,
:func:`typed`, :func:`save_resolved_config`,
:func:`load_config`, :func:`cluster_env`, :data:`CONFIG_DIR`.
"""
from __future__ import annotations

from toolkit.config.environment import ClusterEnv, cluster_env, resolve_device
from toolkit.config.errors import ConfigError, ConfigWarning
from toolkit.config.parallel_name import parallel_name, parse_parallel_name
from toolkit.config.parallel_source import ParallelNameSource, register_parallel_source
from toolkit.config.run_config import CONFIG_DIR, compose, load_config, save_resolved_config
from toolkit.config.schema import TrainConfig, register_schema, typed
from toolkit.config.validate import JobLayout, validate

register_schema()
register_parallel_source()

__all__ = [
    "CONFIG_DIR", "ClusterEnv", "ConfigError", "ConfigWarning", "JobLayout", "ParallelNameSource",
    "TrainConfig", "cluster_env", "compose", "load_config", "parallel_name",
    "parse_parallel_name", "resolve_device", "save_resolved_config", "typed", "validate",
]
