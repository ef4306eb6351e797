"""python -m scripts.reproduce without running a benchmark: the registry, --quick, and the writer's CSV/report/PNG."""
import csv
import sys

import pytest

from scripts.reproduce import FIGURES, load
from scripts.reproduce.__main__ import main, parse
from scripts.reproduce.machine import Machine
from scripts.reproduce.writer import Result, write

# The figures: OneFlow Figs 9, 12, 13, 15, 16 and FlexFlow's Table 5.
EXPECTED = ["fig9", "fig12", "fig13", "fig15", "fig16", "table5"]
# Machine.now() imports torch (seconds on a loaded machine); the writer only needs describe().
MACHINE = Machine("Some CPU", 2, 24.0, "no GPU", "2.x", "3.11", (1.0, 2.0, 3.0), (4.0, 5.0, 6.0))


def test_registry_lists_every_figure_with_its_interface(capsys):
    assert list(FIGURES) == EXPECTED
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == EXPECTED
    for name in EXPECTED:
        module = load(name)
        assert module.TITLE and callable(module.add_arguments) and callable(module.reproduce)
        assert module.TITLE in "\n".join(out)


def test_unknown_figure_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown figure 'fig99'.*fig9, fig12, fig13, fig15, fig16, table5"):
        load("fig99")


@pytest.mark.parametrize("name", EXPECTED)
def test_quick_sets_each_figures_smaller_defaults_and_explicit_options_win(name):
    quick = load(name).QUICK
    assert quick, f"{name} has no --quick defaults"
    normal, _ = parse([name])
    fast, _ = parse([name, "--quick"])
    for key, value in quick.items():
        assert getattr(fast, key) == value and getattr(normal, key) != value, (name, key)
    key, value = next(iter(quick.items()))
    flag = "--" + key.replace("_", "-")
    explicit, _ = parse([name, "--quick", flag, str(getattr(normal, key))])
    assert getattr(explicit, key) == getattr(normal, key)


def _result(plot=None) -> Result:
    rows = [{"layout": "dp2", "tokens_per_s": 1234.5, "fits": True, "peak_mib": None},
            {"layout": "tp2", "tokens_per_s": 0.000123, "fits": False, "peak_mib": 2 ** 20, "extra": "not a column"}]
    return Result("figX", "a title", ["layout", "tokens_per_s", "fits", "peak_mib"], rows, "what ran here",
                  simulated="what was predicted", notes=["a note"], commands=["python scripts/x.py"], plot=plot)


def _plot(result, plt):
    fig, ax = plt.subplots()
    ax.plot([r["tokens_per_s"] for r in result.rows])
    return fig


def test_writer_csv_has_the_columns_and_one_line_per_row(tmp_path):
    text = write(_result(), str(tmp_path), MACHINE)
    with open(tmp_path / "figX.csv", newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == ["layout", "tokens_per_s", "fits", "peak_mib"]
    assert lines[1:] == [["dp2", "1234.5", "True", ""], ["tp2", "0.000123", "False", "1048576"]]
    assert (tmp_path / "figX.txt").read_text().strip() == text.strip()
    body = text.splitlines()
    assert body[:3] == ["== figX: a title", "measured: what ran here", "simulated: what was predicted"]
    assert body[3].startswith("machine: ") and "cores" in body[3] and "at end" in body[3]
    assert "command: python scripts/x.py" in body
    header = next(i for i, line in enumerate(body) if line.split() == ["layout", "tokens_per_s", "fits", "peak_mib"])
    assert body[header + 1].split() == ["dp2", "1,234", "yes", "-"]
    assert body[header + 2].split() == ["tp2", "1.230e-04", "no", "1,048,576"]
    assert "a note" in body and body[-1] == "PNG: none for this figure"


def test_writer_draws_the_png_or_says_why_it_skipped_it(tmp_path, monkeypatch):
    import matplotlib  # noqa: F401  (in the test extra: the PNG path runs in CI)

    text = write(_result(_plot), str(tmp_path / "with"), MACHINE)
    assert (tmp_path / "with" / "figX.png").stat().st_size > 0 and text.endswith(f"PNG: {tmp_path}/with/figX.png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the .[plots] extra were not installed
    text = write(_result(_plot), str(tmp_path / "without"), MACHINE)
    assert not (tmp_path / "without" / "figX.png").exists() and (tmp_path / "without" / "figX.csv").exists()
    assert text.splitlines()[-1].startswith("PNG skipped: matplotlib is not installed (pip install -e '.[plots]')")


def test_a_figure_reproduces_end_to_end_at_its_smallest_size(tmp_path):
    """table5 --quick on one node, as a user runs it: its CSV, table and PNG (about ten seconds on 2 cores; the
    figures that spawn ranks take half a minute or more even at --quick)."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "scripts.reproduce", "table5", "--quick", "--nodes", "1",
                          "--changes", "2", "--repeats", "1", "--out", str(tmp_path)],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SBP_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with open(tmp_path / "table5.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r for r in rows)
    assert (tmp_path / "table5.png").stat().st_size > 0
    assert out.stdout.strip().splitlines()[-1] == f"PNG: {tmp_path}/table5.png"
