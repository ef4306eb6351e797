"""Render a runtime Chrome-trace JSON file as a PNG timeline, with the standard library only.

    python scripts/plot_trace.py trace.json [-o out.png] [--width 1600]

The input is what the actor runtime writes: ``{"traceEvents": [...]}`` or a bare
list of events. Complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds,
``pid`` = rank, ``tid`` = thread/queue) become filled rectangles, one horizontal
track per (rank, thread), sorted by rank then thread name. ``thread_name`` and
``process_name`` metadata events (``"ph": "M"``) name the tracks. A rectangle's
colour depends only on the event name's prefix (text before the first ':' or
' '), so every ``fwd ...`` action shares a colour. The time axis is in ms.

The PNG (8-bit RGB, filter 0) is written with ``zlib`` + ``struct``; labels use
a built-in 5x7 bitmap font (digits, A-Z, space and ``/.:_-()+``; lowercase is
drawn as uppercase, other characters as '?').
"""
import argparse
import colorsys
import hashlib
import json
import math
import struct
import sys
import zlib
from pathlib import Path

BACKGROUND = (255, 255, 255)
_FONT = {" ": "00000000000000"}  # 5x7 glyphs: 7 rows of 5 bits (MSB = left pixel), 2 hex digits a row
_FONT.update(zip(*[iter("""
0 0E11131519110E 1 040C040404040E 2 0E11010204081F 3 1F02040201110E 4 02060A121F0202
5 1F101E0101110E 6 0608101E11110E 7 1F010204080808 8 0E11110E11110E 9 0E11110F01020C
A 0E1111111F1111 B 1E11111E11111E C 0E11101010110E D 1C12111111121C E 1F10101E10101F
F 1F10101E101010 G 0E11101711110F H 1111111F111111 I 0E04040404040E J 0702020202120C
K 11121418141211 L 1010101010101F M 111B1515111111 N 11111915131111 O 0E11111111110E
P 1E11111E101010 Q 0E11111115120D R 1E11111E141211 S 0F10100E01011E T 1F040404040404
U 1111111111110E V 11111111110A04 W 1111111515150A X 11110A040A1111 Y 1111110A040404
Z 1F01020408101F / 00010204081000 . 00000000000C0C : 000C0C000C0C00 _ 0000000000001F
- 0000001F000000 ( 02040808080402 ) 08040202020408 ? 0E110102040004 + 0004041F040400
""".split())] * 2))


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


class _Canvas:
    """An RGB raster with rectangle fill, 5x7 text and PNG output."""

    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(bytes(BACKGROUND) * (w * h))

    def rect(self, x0, y0, x1, y1, rgb):
        x0, x1 = max(0, int(x0)), min(self.w, int(x1))
        y0, y1 = max(0, int(y0)), min(self.h, int(y1))
        if x1 > x0:
            row = bytes(rgb) * (x1 - x0)
            for y in range(y0, y1):
                self.px[(y * self.w + x0) * 3:(y * self.w + x1) * 3] = row

    def text(self, x, y, s, rgb=(30, 30, 30), scale=2):
        """Draw ``s`` with its top-left corner at (x, y); each glyph advances 6*scale pixels."""
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["?"])
            for r in range(7):
                bits = int(glyph[2 * r:2 * r + 2], 16)
                for c in range(5):
                    if bits & (0x10 >> c):
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, rgb)
            x += 6 * scale

    def png(self):
        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        stride = self.w * 3
        raw = b"".join(b"\x00" + bytes(self.px[y * stride:(y + 1) * stride]) for y in range(self.h))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _tick_step(span_ms, target=8):
    """A 1/2/5 x 10^k step giving about ``target`` ticks over ``span_ms``."""
    raw = span_ms / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def render(events_or_path, png_path, width=1600):
    """Draw a trace (a path, a trace object or a list of events) to ``png_path``.

    Returns ``{"path": png_path, "tracks": [track labels], "events": number of X events}``.
    """
    if isinstance(events_or_path, (str, Path)):
        events = load_trace(events_or_path)
    else:
        validate(events_or_path)
        events = events_or_path["traceEvents"] if isinstance(events_or_path, dict) else events_or_path
    tracks = tracks_of(events)
    xs = [ev for _, evs in tracks for ev in evs]
    t0 = min((ev["ts"] for ev in xs), default=0.0)
    span = max((ev["ts"] + ev["dur"] - t0 for ev in xs), default=0.0) or 1.0
    S, TRACK_H, GAP, TOP, AXIS_H = 2, 34, 4, 12, 44
    left = min(max((len(label) for label, _ in tracks), default=10) * 6 * S + 24, width // 3)
    right = width - 24
    height = TOP + len(tracks) * (TRACK_H + GAP) + AXIS_H
    cv = _Canvas(width, height)
    x_of = lambda ts: left + (ts - t0) / span * (right - left)
    axis_y = TOP + len(tracks) * (TRACK_H + GAP)
    for i, (label, _) in enumerate(tracks):  # track stripes and labels
        y = TOP + i * (TRACK_H + GAP)
        cv.rect(left, y, right, y + TRACK_H, (246, 246, 246) if i % 2 else (236, 236, 236))
        cv.text(8, y + (TRACK_H - 7 * S) // 2, label[:(left - 16) // (6 * S)], scale=S)
    step = _tick_step(span / 1000.0)
    k = 0
    while k * step <= span / 1000.0 * (1 + 1e-9):  # ticks, grid lines and tick labels (ms since first event)
        x = int(x_of(t0 + k * step * 1000.0))
        cv.rect(x, TOP, x + 1, axis_y, (210, 210, 210))
        cv.rect(x, axis_y, x + 1, axis_y + 6, (60, 60, 60))
        tick = f"{round(k * step, 9):g}"
        cv.text(min(x - len(tick) * 6 * S // 2, width - len(tick) * 6 * S - 2), axis_y + 10, tick, scale=S)
        k += 1
    cv.rect(left, axis_y, right, axis_y + 1, (60, 60, 60))
    cv.text(8, axis_y + 10, "time (ms)", scale=S)
    for i, (_, evs) in enumerate(tracks):  # the events, with their names where they fit
        y = TOP + i * (TRACK_H + GAP) + 3
        for ev in sorted(evs, key=lambda e: e["ts"]):
            x0, x1 = x_of(ev["ts"]), x_of(ev["ts"] + ev["dur"])
            x0, x1 = int(x0), max(int(x1), int(x0) + 1)
            rgb = color_of(ev["name"])
            cv.rect(x0, y, x1, y + TRACK_H - 6, tuple(c * 3 // 5 for c in rgb))  # darker outline
            cv.rect(x0 + 1, y + 1, x1 - 1, y + TRACK_H - 7, rgb)
            fit = (x1 - x0 - 6) // 6
            if fit >= 3:
                cv.text(x0 + 4, y + (TRACK_H - 6 - 7) // 2, ev["name"][:fit], scale=1)
    Path(png_path).write_bytes(cv.png())
    return {"path": str(png_path), "tracks": [label for label, _ in tracks], "events": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="Chrome-trace JSON file written by the runtime")
    ap.add_argument("-o", "--output", help="PNG to write (default: the trace path with .png)")
    ap.add_argument("--width", type=int, default=1600, help="image width in pixels")
    args = ap.parse_args(argv)
    out = args.output or str(Path(args.trace).with_suffix(".png"))
    try:
        info = render(args.trace, out, width=args.width)
    except ValueError as e:
        sys.exit(f"plot_trace: invalid trace {args.trace}: {e}")
    print(f"wrote {info['path']}: {len(info['tracks'])} tracks, {info['events']} events")


if __name__ == "__main__":
    main()
