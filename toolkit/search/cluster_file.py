"""Cluster files: ``configs/cluster/<name>.yaml`` read into ``toolkit.search.cluster.Cluster``."""
from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.search.cluster import Cluster, cluster_from_dict

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "cluster"


def presets() -> list:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def load_cluster(path) -> Cluster:
    """The ``Cluster`` of a YAML file, or of the preset ``configs/cluster/<name>.yaml`` for a bare name."""
    p = Path(str(path))
    if not p.exists() and not p.suffix:
        p = CLUSTER_DIR / f"{path}.yaml"
    if not p.exists():
        raise ValueError(f"cluster {str(path)!r}: no such file; presets: {', '.join(presets())}")
    return cluster_from_dict(yaml.safe_load(p.read_text()) or {}, str(p))
