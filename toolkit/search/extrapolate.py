"""A deep stage's rehearsal from rehearsals of the same stage with 2 and 3 layers.

Every layer past the third adds what the third added over the second: the
extra events (its ops, its collectives), its global ops, its bytes. Most
events of a stage are per layer or per parameter, so the third layer's are
those in the 3-layer trace and not in the 2-layer one. A few ops take *all*
the stage's parameters at once (``torch._foreach_norm`` over the gradients
in ``sc.clip_grad_norm_``, then ``stack`` of the norms and a ``pow``/``sum``
over them): their 3-layer call is their 2-layer call with one more layer's
tensors in its lists and one more layer's length in its 1-D shapes. Such an
event *grows*: its deep call has ``blocks - 2`` layers' worth in each list
(inserted where the 3-layer list has the third layer's, so the call equals
what a direct rehearsal of the deep stage records) and in each changed
dimension. An event of the 2-layer trace that neither recurs nor grows
means the layers are not uniform: no extrapolation (``None``).
"""
from __future__ import annotations

from collections import Counter

from sbp_core.layout import strides_in_order
from toolkit.search.rehearsal import OpCall, PhaseTrace, TensorSpec
from toolkit.search.stage_trace import StageTrace


def _contiguous(shape: tuple) -> tuple:
    return strides_in_order(shape, range(len(shape)))


def _grown(a2, a3, extra: int):
    """``a3`` with ``extra`` more layers' worth of what it has over ``a2`` (None: not a growth)."""
    if a2 == a3:
        return a3
    if isinstance(a3, TensorSpec) and isinstance(a2, TensorSpec):
        if len(a2.shape) != len(a3.shape) or a2.dtype != a3.dtype or a3.stride != _contiguous(a3.shape):
            return None
        shape = tuple(n3 + (n3 - n2) * extra for n2, n3 in zip(a2.shape, a3.shape))
        return TensorSpec(shape, _contiguous(shape), a3.dtype)
    if isinstance(a3, tuple) and isinstance(a2, tuple) and not isinstance(a3, TensorSpec):
        if len(a2) == len(a3):
            out = tuple(_grown(x, y, extra) for x, y in zip(a2, a3))
            return None if any(v is None for v in out) else out
        k = len(a3) - len(a2)  # a3 is a2 with one layer's block of k items inserted at i
        i = next((j for j in range(len(a2)) if a2[j] != a3[j]), len(a2))
        if k <= 0 or a3[:i] != a2[:i] or a3[i + k:] != a2[i:]:
            return None
        return a3[:i] + a3[i:i + k] * (1 + extra) + a3[i + k:]
    return None


def _grow_event(e2, e3, extra: int):
    if not (isinstance(e2, OpCall) and isinstance(e3, OpCall)) or e2.op != e3.op or e2.module != e3.module:
        return None
    args = _grown(e2.args, e3.args, extra)
    return None if args is None else OpCall(e3.op, args, e3.module)


def _phase(p2: PhaseTrace, p3: PhaseTrace, extra: int) -> PhaseTrace | None:
    c2, c3 = Counter(p2.events), Counter(p3.events)
    gone = list((c2 - c3).elements())  # events of 2 layers the 3-layer trace has otherwise: must grow
    new = c3 - c2
    grown: dict = {}  # id of the 3-layer event's position -> its deep version
    for e2 in gone:
        match = next((j for j, e3 in enumerate(p3.events) if j not in grown and new[e3] > 0
                      and _grow_event(e2, e3, extra) is not None), None)
        if match is None:
            return None  # the shallower stage did something the deeper did not: layers are not uniform
        e3 = p3.events[match]
        new[e3] -= 1
        grown[match] = _grow_event(e2, e3, extra)
    added = list((+new).elements())
    events = [grown.get(j, e) for j, e in enumerate(p3.events)] + added * extra
    g_added = p3.global_ops[len(p2.global_ops):]
    return PhaseTrace(p3.name, events, list(p3.global_ops) + list(g_added) * extra,
                      p3.peak_bytes + extra * max(0, p3.peak_bytes - p2.peak_bytes),
                      p3.end_bytes + extra * max(0, p3.end_bytes - p2.end_bytes))


def extrapolate(t2: StageTrace, t3: StageTrace, blocks: int) -> StageTrace | None:
    """The stage with ``blocks`` layers from its 2- and 3-layer traces (module docstring); None if not uniform."""
    extra = blocks - 3
    out = StageTrace(t3.dp, t3.tp)
    for name, p3 in t3.phases.items():
        phase = _phase(t2.phases[name], p3, extra)
        if phase is None:
            return None
        out.phases[name] = phase
    for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "stash_bytes"):
        a, b = getattr(t2, k), getattr(t3, k)
        setattr(out, k, b + extra * (b - a))
    out.act_bytes, out.plain = t3.act_bytes, t3.plain
    return out
