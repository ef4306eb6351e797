"""What a pipelined step's trace says: micro-batches held per stage, and the bubble.

Works on ``Trace.wall_events()`` of the ranks of one machine (wall-clock
seconds line up across processes). A stage holds micro-batch ``k``'s
activations from the start of its forward ``s{s}.F@r`` piece ``k`` to the
end of its backward ``s{s}.B@r`` piece ``k``. The bubble of a stage is the
fraction of the step (first forward anywhere to last backward anywhere) in
which its rank runs neither a forward nor a backward; the theory for equal
forward and backward times is ``(p - 1) / (m + p - 1)``.
"""
from __future__ import annotations

import re

_FB = re.compile(r"^s(\d+)\.([FB])@(\d+)$")


def _fb(events):
    for name, start, end, piece in events:
        m = _FB.match(name)
        if m:
            yield int(m.group(1)), m.group(2), start, end, piece


def peak_held(events) -> int:
    """Most micro-batches whose activations one rank held at once."""
    marks = []
    for _, kind, start, end, _ in _fb(events):
        marks.append((start, 1) if kind == "F" else (end, -1))
    held = peak = 0
    for _, d in sorted(marks, key=lambda x: (x[0], x[1])):
        held += d
        peak = max(peak, held)
    return peak


def bubble(per_rank: dict) -> dict:
    """``{stage: idle fraction}`` from ``{rank: wall_events}`` (one rank per stage is enough)."""
    spans, busy = [], {}
    for events in per_rank.values():
        for stage, _, start, end, _ in _fb(events):
            spans.append((start, end))
    if not spans:
        return {}
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    seen = {}
    for rank, events in sorted(per_rank.items()):
        for stage, _, start, end, _ in _fb(events):
            if seen.setdefault(stage, rank) == rank:
                busy[stage] = busy.get(stage, 0.0) + (end - start)
    return {s: 1.0 - b / (t1 - t0) for s, b in sorted(busy.items())}


def theory(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)
