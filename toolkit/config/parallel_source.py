"""A Hydra config source that answers ``parallel=<any layout name>`` without a YAML file.

Why a config source: ``parallel=dp3_tp2`` must work for every name of the
grammar in :mod:`toolkit.config.parallel_name`, on the command line, in
multirun sweeps (``parallel=dp2,tp2,dp2_tp2``) and through Hydra's compose
API alike. Rewriting ``sys.argv`` before Hydra parses it would miss sweeps
and the compose API, and writing YAML files on demand races between ranks;
a config source is the hook Hydra itself offers for "configs that are not
files", so the name is resolved where Hydra resolves every other choice.

How: ``configs/config.yaml`` puts ``sbp-parallel://`` on ``hydra.searchpath``
*after* the YAML directory, so the files in ``configs/parallel/`` win and this
source answers only the names that have no file. It claims every config in
group ``parallel`` whose name consists of letters, digits and ``_``; loading
parses the name (so a malformed one fails with the grammar in the message)
and returns ``{dp, cp, tp, pp, zero}``; the other parallel fields keep their
schema defaults and can still be overridden (``parallel.pp_schedule=gpipe``).

The scheme must be registered before Hydra composes:
:func:`register_parallel_source` does so through Hydra's public
``Plugins.register`` and is called when :mod:`toolkit.config` is imported.
"""
from __future__ import annotations

import re
from typing import List, Optional

from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import OmegaConf

from toolkit.config.errors import ConfigError
from toolkit.config.parallel_name import parse_parallel_name

SCHEME = "sbp-parallel"
GROUP = "parallel"
_CANDIDATE = re.compile(r"^[A-Za-z0-9_]+$")


def _layout_name(config_path: str) -> Optional[str]:
    """``"parallel/dp2_tp2.yaml"`` -> ``"dp2_tp2"``; ``None`` outside the group."""
    path = config_path.strip("/")
    if path.endswith(".yaml"):
        path = path[: -len(".yaml")]
    group, _, name = path.rpartition("/")
    if group != GROUP or not _CANDIDATE.match(name):
        return None
    return name


class ParallelNameSource(ConfigSource):
    """Synthesises ``parallel/<name>`` configs from layout names (see module docstring)."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        name = _layout_name(config_path)
        if name is None:
            raise ConfigLoadError(f"{SCHEME}:// only provides configs of group '{GROUP}', "
                                  f"not {config_path!r}")
        try:
            degrees = parse_parallel_name(name)
        except ConfigError as err:
            raise ConfigLoadError(str(err)) from err
        return ConfigResult(config=OmegaConf.create(degrees), path=f"{SCHEME}://{self.path}",
                            provider=self.provider, header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") == GROUP

    def is_config(self, config_path: str) -> bool:
        return _layout_name(config_path) is not None

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        # The names are unbounded; the YAML files list the documented ones.
        if config_path.strip("/") == "" and results_filter in (None, ObjectType.GROUP):
            return [GROUP]
        return []


def register_parallel_source() -> None:
    """Make ``sbp-parallel://`` resolvable on Hydra's search path (idempotent)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(ParallelNameSource)
