"""scripts/plot_trace.py: validation of Chrome traces and the matplotlib PNG timeline."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import plot_trace

ROOT = Path(__file__).resolve().parents[2]


def _trace():
    """2 ranks x 2 threads; rank 0 names its threads with metadata (numeric tids), rank 1 uses string tids."""
    ev = lambda name, ts, dur, pid, tid: {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2, "args": {"name": "copy"}},
        ev("fwd:mb0", 0.0, 3000.0, 0, 1), ev("fwd:mb1", 3200.0, 3000.0, 0, 1), ev("bwd:mb0", 6500.0, 5000.0, 0, 1),
        ev("h2d mb0", 500.0, 1500.0, 0, 2),
        ev("send:act0", 2000.0, 1000.0, 1, "network"), ev("recv:grad0", 7000.0, 1500.0, 1, "network"),
        ev("optim", 9000.0, 2500.0, 1, "compute"),
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _read_png(path):
    """``(width, height, rows of (r, g, b) tuples)`` of a PNG, read by matplotlib."""
    from matplotlib.image import imread

    px = (imread(str(path))[:, :, :3] * 255).round().astype("uint8")
    return px.shape[1], px.shape[0], [[tuple(int(c) for c in p) for p in row] for row in px]


def test_render_tracks_and_colours(tmp_path):
    trace = _trace()
    plot_trace.validate(trace)
    out = tmp_path / "t.png"
    info = plot_trace.render(trace, out, width=800)
    assert info["events"] == 7
    assert info["tracks"] == ["rank 0 / compute", "rank 0 / copy", "rank 1 / compute", "rank 1 / network"]
    w, h, rows = _read_png(out)
    assert w == 800 and h > 4 * 30
    # Same prefix -> same colour; different prefixes here -> different colours.
    assert plot_trace.color_of("fwd:mb0") == plot_trace.color_of("fwd:mb1") == plot_trace.color_of("fwd x")
    expected = [{"fwd", "bwd"}, {"h2d"}, {"optim"}, {"send", "recv"}]
    colours = {p: plot_trace.color_of(p) for names in expected for p in names}
    assert len(set(colours.values())) == len(colours)
    # Scanning down, the bands of rows holding event colours are the 4 tracks in order, none mixing tracks.
    found = []
    for y in range(h):
        present = {p for p, c in colours.items() if c in set(rows[y])}
        if present and (not found or found[-1][1] != present):
            found.append((y, present))
    assert [names for _, names in found] == expected, found
    background = {plot_trace.BACKGROUND}
    for (y, names) in found:
        event_colours = {colours[p] for p in names}
        assert event_colours <= set(rows[y]) - background


def test_only_the_tracks_asked_for(tmp_path):
    info = plot_trace.render(_trace(), tmp_path / "c.png", width=400, only="compute")
    assert info["tracks"] == ["rank 0 / compute", "rank 1 / compute"] and info["events"] == 4


def test_cli_and_bare_list(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()["traceEvents"]))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_trace.py"), str(path)],
                         capture_output=True, text=True, check=True)
    assert f"{tmp_path / 'trace.png'}: 4 tracks, 7 events" in res.stdout
    assert _read_png(tmp_path / "trace.png")[0] == 1600


@pytest.mark.parametrize("trace, msg", [
    ({"events": []}, "traceEvents"),
    ("nope", "list of events"),
    ([{"name": "a", "ph": "X", "ts": 0, "pid": 0, "tid": 0}], "missing dur"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": -1, "pid": 0, "tid": 0}], "negative dur"),
    ([{"name": "a", "ph": "X", "ts": "0", "dur": 1, "pid": 0, "tid": 0}], "ts must be"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 1.5}], "tid must be"),
    ([3], "not an object"),
])
def test_validate_rejects(trace, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        plot_trace.validate(trace)
    if not isinstance(trace, str):  # render() reads a str as a path
        with pytest.raises(ValueError):
            plot_trace.render(trace, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_cli_rejects_broken_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": -5, "pid": 0, "tid": 0}]}))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_trace.py"), str(path)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "negative dur" in res.stderr
