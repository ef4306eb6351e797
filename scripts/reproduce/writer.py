"""A reproduced figure's outputs: ``<out>/<name>.csv``, a printed table (also ``<name>.txt``) and ``<name>.png``.

A figure module returns a ``Result``: its rows (one dict per CSV line, the
keys ``columns`` lists), what was measured on this machine and what was
simulated at paper scale, the commands that produced the numbers, the
summary lines to print under the table, and a ``plot(result, plt)``
drawing it with matplotlib (``meta``: what it needs besides the rows). ``write`` writes the CSV and the report first,
so without matplotlib (the optional ``.[plots]`` extra) everything but the
PNG is still there and the report says the PNG was skipped and why.
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from typing import Callable

from .machine import Machine

PLOTS_HINT = "pip install -e '.[plots]'"


@dataclass
class Result:
    name: str
    title: str
    columns: list
    rows: list
    measured: str
    simulated: str = ""
    notes: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    plot: Callable | None = None  # plot(result, matplotlib.pyplot) -> matplotlib Figure
    meta: dict = field(default_factory=dict)  # what the plot needs besides the rows (e.g. a budget line)


def cell(value) -> str:
    """How a table shows a value: ``-`` for missing, ``yes``/``no``, integers with separators, 4 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:,.{max(0, 3 - int(math.floor(math.log10(abs(value)))))}f}" if value else "0"
    return str(value)


def format_table(columns: list, rows: list) -> str:
    """Right-aligned columns (text columns left-aligned), one header line."""
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    text = [all(not isinstance(r.get(c), (int, float)) or isinstance(r.get(c), bool) for r in rows) for c in columns]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values):
        return "  ".join(v.ljust(w) if t else v.rjust(w) for v, w, t in zip(values, widths, text)).rstrip()

    return "\n".join([line(columns)] + [line(row) for row in cells])


def write_csv(path: str, columns: list, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})


def write_png(result: Result, path: str, machine: Machine) -> str:
    """Draw ``result`` into ``path``; the line the report prints about it (written, skipped and why)."""
    if result.plot is None:
        return "PNG: none for this figure"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"PNG skipped: matplotlib is not installed ({PLOTS_HINT}); the CSV and this table are complete"
    fig = result.plot(result, plt)
    fig.suptitle(result.title, fontsize=10)
    fig.text(0.5, 0.005, machine.describe(), ha="center", va="bottom", fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"PNG: {path}"


def report(result: Result, machine: Machine) -> str:
    parts = [f"== {result.name}: {result.title}", f"measured: {result.measured}"]
    if result.simulated:
        parts.append(f"simulated: {result.simulated}")
    parts.append(f"machine: {machine.describe()}")
    parts += [f"command: {c}" for c in result.commands]
    parts += ["", format_table(result.columns, result.rows), ""] + list(result.notes)
    return "\n".join(parts)


def write(result: Result, out_dir: str, machine: Machine) -> str:
    """Write ``<out_dir>/<name>.csv``, ``.txt`` and ``.png``; print and return the report."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, result.name)
    write_csv(base + ".csv", result.columns, result.rows)
    text = report(result, machine) + f"\nCSV: {base}.csv\n"
    with open(base + ".txt", "w") as f:
        f.write(text)
    png = write_png(result, base + ".png", machine)
    with open(base + ".txt", "a") as f:
        f.write(png + "\n")
    print("\n" + text + png, flush=True)
    return text + png
