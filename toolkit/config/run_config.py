"""The config as a file: where the YAML tree lives, composing it in code, the run directory's copy.

- :data:`CONFIG_DIR`: the absolute path of ``configs/`` (for ``@hydra.main``).
- :func:`compose`: Hydra's compose API on ``configs/`` with overrides, for
  tests, notebooks and scripts (no run directory, no logging setup; pass
  ``run_dir=...`` to set one).
- :func:`save_resolved_config`: ``<run_dir>/config.yaml`` with every
  interpolation resolved, the record of what a run actually used.
- :func:`load_config`: read such a file back as a typed config (resume).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from toolkit.config.schema import typed

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
RESOLVED_NAME = "config.yaml"


def compose(overrides: Sequence[str] = (), config_name: str = "config",
            run_dir: str | None = None) -> DictConfig:
    """The composed config for ``overrides`` (command-line syntax, e.g. ``["parallel=dp2_tp2"]``).

    ``run_dir`` replaces the ``${hydra:runtime.output_dir}`` interpolation,
    which only resolves inside a Hydra run. Raises Hydra's errors for unknown
    groups, keys and types.
    """
    from hydra import compose as hydra_compose, initialize_config_dir

    overrides = list(overrides)
    if run_dir is not None:
        overrides.append(f"run_dir={run_dir}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def save_resolved_config(cfg: Any, run_dir: str | Path) -> Path:
    """Write ``cfg`` with interpolations resolved to ``<run_dir>/config.yaml``; returns the path."""
    path = Path(run_dir) / RESOLVED_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    container = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
    return path


def load_config(path: str | Path) -> DictConfig:
    """A typed config from a YAML file (e.g. a run's ``config.yaml``) or a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / RESOLVED_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no config at {str(path)!r}; valid: a YAML file or a run directory "
                                f"holding {RESOLVED_NAME}")
    return typed(OmegaConf.load(path))
