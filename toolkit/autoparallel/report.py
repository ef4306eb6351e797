"""A found plan in words: its ``dpX_tpY_ppZ`` name, predicted time and memory, and the per-op SBP table."""
from __future__ import annotations

import fnmatch

from sbp_core.sbp import format_sbp

# Ops that only re-view or alias a tensor: left out of the per-op table.
_VIEWS = {"view", "_unsafe_view", "transpose", "t", "detach", "split", "slice", "unsqueeze", "expand", "permute",
          "alias", "select", "squeeze", "reshape", "as_strided", "clone"}


def parameter_table(plan: dict, shapes: dict) -> list:
    """``[(parameter, shape, N-d SBP)]`` of every parameter under ``plan`` (first matching pattern, else ``B``)."""
    rows = []
    for name, shape in sorted(shapes.items()):
        sbp = next((v for k, v in plan.items() if ":" not in k and fnmatch.fnmatchcase(name, k)), None)
        rows.append((name, shape, format_sbp(sbp) if sbp is not None else "(B, B)"))
    return rows


def op_table(trace, stage: int) -> list:
    """``[(stage, module, op, input SBPs, chosen input SBPs, output SBPs, boxing bytes)]`` of a stage's forward."""
    rows = []
    for g in trace.phases["F"].global_ops:
        short = g.op.split(".")[1] if g.op.count(".") >= 2 else g.op
        if short in _VIEWS:
            continue
        req = "decomposed" if g.required == "decomposed" else ", ".join(format_sbp(r) for r in g.required)
        rows.append((stage, g.module or "-", short, ", ".join(format_sbp(a) for a in g.inputs), req,
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
    for name, shape, sbp in parameter_table(plan, shapes):
        lines.append(f"  {name:45s} {str(shape):18s} {sbp}")
    lines += ["", "per-op signatures (forward, views left out): stage | module | op | inputs => chosen -> outputs | boxing"]
    rows = [r for st, tr in enumerate(prediction.traces) for r in op_table(tr, st)]
    for st, mod, op, ins, req, outs, nbytes in rows[:max_ops]:
        lines.append(f"  {st} | {mod:32s} | {op:40s} | {ins} => {req} -> {outs} | {nbytes:.0f} B")
    if len(rows) > max_ops:
        lines.append(f"  ... {len(rows) - max_ops} more")
    return "\n".join(lines)
