"""Reproduce the OneFlow (and FlexFlow) papers' benchmark figures on this machine: ``python -m scripts.reproduce``.

One module per figure; each measures at small scale by running the
project's benchmark scripts (``scripts/bench_*.py --json``), or predicts at
paper scale with the auto-parallel simulator (``simulated.py``), and writes
``reproduce/<figure>.csv``, ``.txt`` (the printed report: what was measured
and simulated, the machine, the commands, the table) and ``.png``
(matplotlib, the optional ``.[plots]`` extra). ``FIGURES`` maps a figure's
name to its module, in the order ``all`` runs them. A figure module has
``TITLE``, ``QUICK`` (argument defaults of ``--quick``: a smoke-sized run),
``add_arguments(parser)`` and ``reproduce(args, bench) -> writer.Result``.
"""
from __future__ import annotations

import importlib

FIGURES = {
    "fig9": "scripts.reproduce.fig9_data_pipeline",
    "fig12": "scripts.reproduce.fig12_insightface",
    "fig13": "scripts.reproduce.fig13_wide_deep",
    "fig15": "scripts.reproduce.fig15_zero",
    "fig16": "scripts.reproduce.fig16_gpt",
    "table5": "scripts.reproduce.table5_simulation",
}


def load(name: str):
    """The module of figure ``name``; ``ValueError`` naming the valid figures otherwise."""
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}; valid: {', '.join(FIGURES)}")
    return importlib.import_module(FIGURES[name])
