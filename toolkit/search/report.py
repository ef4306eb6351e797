"""A found plan in words: its ``dpX_tpY_ppZ`` name, predicted time and memory, and the per-op SBP table."""
from __future__ import annotations

import fnmatch

from sbp_core.sbp import Broadcast, format_sbp

# Ops that only re-view or alias a tensor: left out of the per-op table.
_VIEWS = {"view", "_unsafe_view", "transpose", "t", "detach", "split", "slice", "unsqueeze", "expand", "permute",
          "alias", "select", "squeeze", "reshape", "as_strided", "clone"}


def parameter_table(plan: dict, shapes: dict, mesh: tuple) -> list:
    """``[(parameter, shape, N-d SBP)]`` of every parameter under ``plan`` on a ``mesh``-shaped stage.

    First matching pattern, else ``B``; a split over a one-device axis is
    ``B`` (as ``distribute_module`` lays it out).
    """
    rows = []
    for name, shape in sorted(shapes.items()):
        sbp = next((v for k, v in plan.items() if ":" not in k and fnmatch.fnmatchcase(name, k)), None)
        sbp = tuple(Broadcast() if sbp is None or (n == 1 and x.is_split) else x
                    for x, n in zip(sbp or (None,) * len(mesh), mesh))
        rows.append((name, shape, format_sbp(sbp)))
    return rows


def op_table(trace, stage) -> list:
    """``[(stage(s), module, op, input SBPs, chosen input SBPs, output SBPs, boxing bytes)]`` of a stage's forward."""
    rows = []
    for g in trace.phases["F"].global_ops:
        short = g.op.split(".")[1] if g.op.count(".") >= 2 else g.op
        if short in _VIEWS:
            continue
        req = "decomposed" if g.required == "decomposed" else ", ".join(format_sbp(r) for r in g.required)
        ins = ", ".join(f"{format_sbp(a)}{list(sh)}" for a, sh in zip(g.inputs, g.shapes)) if g.shapes else \
            ", ".join(format_sbp(a) for a in g.inputs)
        rows.append((stage, g.module or "-", short, ins, req,
                     ", ".join(format_sbp(o) for o in g.outputs), g.boxing_bytes))
    return rows


def describe(prediction, plan: dict, shapes: dict, micro_batches: int, max_ops: int = 60) -> str:
    """The report ``search_plan.py`` and ``parallel=auto`` print."""
    s = prediction.strategy
    lines = [f"plan: {s.name}  (micro-batch size {s.micro_batch_size}, {micro_batches} micro-batches, "
             f"sequence parallel {'on' if s.sequence_parallel else 'off'}, ZeRO {s.zero})",
             f"predicted step time {prediction.step_seconds:.4g} s, peak memory per device "
             f"{prediction.peak_memory / 2**30:.3g} GiB of {prediction.capacity / 2**30:.3g} GiB",
             "", "parameter layouts on each stage's (dp, tp) mesh:"]
    for name, shape, sbp in parameter_table(plan, shapes, (s.dp, s.tp)):
        lines.append(f"  {name:45s} {str(shape):18s} {sbp}")
    lines += ["", "per-op signatures (forward, views left out; stages of the same shape share one rehearsal, "
              "named by its modules): stage | module | op | inputs => chosen -> outputs | boxing"]
    groups: dict = {}
    for st, tr in enumerate(prediction.traces):
        groups.setdefault(id(tr), (tr, []))[1].append(str(st))
    rows = [r for tr, stages in groups.values() for r in op_table(tr, ",".join(stages))]
    for st, mod, op, ins, req, outs, nbytes in rows[:max_ops]:
        lines.append(f"  {st:5s} | {mod:30s} | {op:40s} | {ins} => {req} -> {outs} | {nbytes:.0f} B")
    if len(rows) > max_ops:
        lines.append(f"  ... {len(rows) - max_ops} more")
    return "\n".join(lines)
