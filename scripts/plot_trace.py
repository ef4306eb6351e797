"""Render a runtime Chrome-trace JSON file as a PNG timeline (matplotlib, the ``plots`` extra).

    python scripts/plot_trace.py trace.json [-o out.png] [--width 1600] [--tracks compute]

The input is what the actor runtime writes: ``{"traceEvents": [...]}`` or a bare
list of events. Complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds,
``pid`` = rank, ``tid`` = thread/queue) become filled rectangles, one horizontal
track per (rank, thread), sorted by rank then thread name. ``thread_name`` and
``process_name`` metadata events (``"ph": "M"``) name the tracks. A rectangle's
colour depends only on the event name's prefix (text before the first ':' or
' '), so every ``fwd ...`` action shares a colour. The time axis is in ms.
``--tracks`` keeps the tracks whose label contains a text (``compute``: the
actions that use the device, without the transfers' waits).
"""
import argparse
import colorsys
import hashlib
import json
import math
import sys
from pathlib import Path

BACKGROUND = (255, 255, 255)


def load_trace(path):
    """Read a Chrome-trace JSON file, validate it and return its list of events."""
    with open(path) as f:
        trace = json.load(f)
    validate(trace)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def validate(trace):
    """Raise ValueError unless ``trace`` is a Chrome trace we can draw (object with traceEvents, or list)."""
    if isinstance(trace, dict):
        if "traceEvents" not in trace:
            raise ValueError("trace object has no 'traceEvents' key")
        trace = trace["traceEvents"]
    if not isinstance(trace, list):
        raise ValueError(f"trace must be a list of events or an object with 'traceEvents', got {type(trace).__name__}")
    for i, ev in enumerate(trace):
        if not isinstance(ev, dict):
            raise ValueError(f"event {i} is not an object: {ev!r}")
        if ev.get("ph") != "X":
            continue
        missing = [k for k in ("name", "ts", "dur", "pid", "tid") if k not in ev]
        if missing:
            raise ValueError(f"X event {i} ({ev.get('name', '?')!r}) is missing {', '.join(missing)}")
        if not isinstance(ev["name"], str):
            raise ValueError(f"X event {i}: name must be a string, got {ev['name']!r}")
        for k in ("ts", "dur"):
            v = ev[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"X event {i} ({ev['name']!r}): {k} must be a finite number, got {v!r}")
        if ev["dur"] < 0:
            raise ValueError(f"X event {i} ({ev['name']!r}) has negative dur {ev['dur']}")
        if isinstance(ev["pid"], bool) or not isinstance(ev["pid"], int):
            raise ValueError(f"X event {i} ({ev['name']!r}): pid (rank) must be an int, got {ev['pid']!r}")
        if isinstance(ev["tid"], bool) or not isinstance(ev["tid"], (int, str)):
            raise ValueError(f"X event {i} ({ev['name']!r}): tid must be an int or a string, got {ev['tid']!r}")


def color_of(name):
    """Deterministic RGB colour for an event name, from its prefix before the first ':' or ' '."""
    prefix = name.split(":", 1)[0].split(" ", 1)[0]
    d = hashlib.blake2s(prefix.encode(), digest_size=4).digest()
    r, g, b = colorsys.hsv_to_rgb((d[0] * 256 + d[1]) / 65536.0, 0.40 + d[2] % 35 / 100.0, 0.75 + d[3] % 20 / 100.0)
    return int(r * 255), int(g * 255), int(b * 255)


def tracks_of(events):
    """Group X events by track: returns ``[(label, [events])]`` sorted by rank then thread name."""
    threads, procs = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and isinstance(ev.get("args"), dict) and "name" in ev["args"]:
            if ev.get("name") == "thread_name":
                threads[(ev.get("pid"), ev.get("tid"))] = str(ev["args"]["name"])
            elif ev.get("name") == "process_name":
                procs[ev.get("pid")] = str(ev["args"]["name"])
    groups = {}
    for ev in events:
        if ev.get("ph") == "X":
            groups.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    keyed = []
    for (pid, tid), evs in groups.items():
        thread = threads.get((pid, tid), str(tid))
        keyed.append(((pid, thread, str(tid)), f"{procs.get(pid, f'rank {pid}')} / {thread}", evs))
    return [(label, evs) for _, label, evs in sorted(keyed)]


def _label(name: str, fit: int) -> str:
    return name[:fit] if fit >= 3 else ""


def render(events_or_path, png_path, width=1600, only: str | None = None):
    """Draw a trace (a path, a trace object or a list of events) to ``png_path`` with matplotlib.

    One horizontal band per track, events as filled bars in their prefix's
    colour (``color_of``; no antialiasing, so a bar's pixels are that colour),
    their names where they fit; time in ms from the first event.
    ``only``: keep the tracks whose label contains it.
    Returns ``{"path": png_path, "tracks": [track labels], "events": number of X events}``.
    """
    try:
        import matplotlib
    except ImportError:  # the plots extra
        raise SystemExit("plot_trace needs matplotlib: pip install -e '.[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(events_or_path, (str, Path)):
        events = load_trace(events_or_path)
    else:
        validate(events_or_path)
        events = events_or_path["traceEvents"] if isinstance(events_or_path, dict) else events_or_path
    tracks = [(label, evs) for label, evs in tracks_of(events) if only is None or only in label]
    xs = [ev for _, evs in tracks for ev in evs]
    t0 = min((ev["ts"] for ev in xs), default=0.0)
    span_ms = (max((ev["ts"] + ev["dur"] - t0 for ev in xs), default=0.0) or 1.0) / 1000.0
    dpi = 100
    fig, ax = plt.subplots(figsize=(width / dpi, 0.45 * len(tracks) + 0.9), dpi=dpi)
    fig.subplots_adjust(left=0.2, right=0.98, top=1 - 0.1 / (0.45 * len(tracks) + 0.9),
                        bottom=0.6 / (0.45 * len(tracks) + 0.9))
    px_per_ms = 0.78 * width / span_ms
    for i, (_, evs) in enumerate(tracks):
        for ev in evs:
            x, w = (ev["ts"] - t0) / 1000.0, ev["dur"] / 1000.0
            rgb = tuple(c / 255 for c in color_of(ev["name"]))
            ax.broken_barh([(x, w)], (i - 0.4, 0.8), facecolors=[rgb], edgecolors=[tuple(c * 0.6 for c in rgb)],
                           linewidth=0.5, antialiased=False)
            label = _label(ev["name"], int(w * px_per_ms) // 6)
            if label:
                ax.text(x + w / 2, i, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(tracks)), [label for label, _ in tracks])
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#d2d2d2", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.savefig(png_path, dpi=dpi)
    plt.close(fig)
    return {"path": str(png_path), "tracks": [label for label, _ in tracks], "events": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="Chrome-trace JSON file written by the runtime")
    ap.add_argument("-o", "--output", help="PNG to write (default: the trace path with .png)")
    ap.add_argument("--width", type=int, default=1600, help="image width in pixels")
    ap.add_argument("--tracks", default=None, help="draw only the tracks whose label contains this (e.g. compute)")
    args = ap.parse_args(argv)
    out = args.output or str(Path(args.trace).with_suffix(".png"))
    try:
        info = render(args.trace, out, width=args.width, only=args.tracks)
    except ValueError as e:
        sys.exit(f"plot_trace: invalid trace {args.trace}: {e}")
    print(f"wrote {info['path']}: {len(info['tracks'])} tracks, {info['events']} events")


if __name__ == "__main__":
    main()
