"""What a pipelined step's trace says: micro-batches held per rank, and the bubble.

Works on ``Trace.wall_events()`` of the ranks of one machine (wall-clock
seconds line up across processes). A rank holds micro-batch ``k``'s
activations of stage ``s`` from the start of its forward ``s{s}.F@r`` piece
``k`` to the end of its backward ``s{s}.B@r`` piece ``k``, or of its
weight pass ``s{s}.W@r`` where the schedule has one (zero bubble: the
weight pass still needs them). The bubble of a pipeline rank is the
fraction of the step (first forward anywhere to last backward or weight
pass anywhere) in which it runs no forward, backward or weight pass; the
theory for equal forward and backward times is ``(p - 1) / (v m + p - 1)``
(``v`` stages per rank: Megatron's interleaving divides the idle time by
``v``).
"""
from __future__ import annotations

import re

_FBW = re.compile(r"^s(\d+)\.([FBW])@(\d+)$")


def _fbw(events):
    for name, start, end, piece in events:
        m = _FBW.match(name)
        if m:
            yield int(m.group(1)), m.group(2), start, end, piece


def peak_held(events) -> int:
    """Most micro-batches (of any of its stages) whose activations one rank held at once."""
    starts, ends = [], {}
    for stage, kind, start, end, piece in _fbw(events):
        if kind == "F":
            starts.append(start)
        else:  # the later of the backward and the weight pass releases them
            ends[(stage, piece)] = max(ends.get((stage, piece), end), end)
    marks = [(t, 1) for t in starts] + [(t, -1) for t in ends.values()]
    held = peak = 0
    for _, d in sorted(marks, key=lambda x: (x[0], x[1])):
        held += d
        peak = max(peak, held)
    return peak


def bubble(per_rank: dict) -> dict:
    """``{key: idle fraction}`` from ``{key: wall_events}``, one entry per pipeline rank (any one of its devices)."""
    spans = [(start, end) for events in per_rank.values() for _, _, start, end, _ in _fbw(events)]
    if not spans:
        return {}
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    busy = {key: sum(end - start for _, _, start, end, _ in _fbw(events)) for key, events in per_rank.items()}
    return {key: 1.0 - b / (t1 - t0) for key, b in sorted(busy.items())}


def theory(pp: int, m: int, v: int = 1) -> float:
    """1F1B's bubble for equal forward and backward times, ``v`` stages per rank interleaved."""
    return (pp - 1) / (v * m + pp - 1)
