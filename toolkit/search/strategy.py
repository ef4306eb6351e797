"""A parallel strategy as data: degrees, ZeRO stage, micro-batching, sequence parallel and per-op layouts.

``Strategy`` is what the search proposes and the simulator prices, and what
a plan file stores for training to run unchanged:

- ``dp``, ``tp``, ``pp``: the ``dpX_tpY_ppZ`` layout (rank =
  ``pp_i*dp*tp + dp_i*tp + tp_i``; each stage is the ``(dp, tp)`` mesh of
  its ranks);
- ``zero``: ZeRO stage 0..3 over the dp axis;
- ``micro_batch_size``: rows per micro-batch per data shard (the number of
  micro-batches is ``global_batch / (micro_batch_size * shards)``, shards
  being ``dp`` for a batch laid out ``(S(0), B)``);
- ``sequence_parallel``: the recipe's sequence-parallel activation pins;
- ``schedule``, ``virtual``: the pipeline schedule and stages per pipeline
  rank (``parallel.pp_schedule``, ``parallel.pp_virtual``), so the search
  chooses them with the rest (``stages`` = ``pp * virtual``);
- ``ops``: per-op signature choices, as ``(parameter pattern, tp-axis SBP)``
  pairs that override the recipe's plan (the dp axis of a parameter is
  ``B``; ZeRO shards it), e.g. ``("*.mlp.c_fc.weight", "B")`` runs that op
  replicated instead of column-parallel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from runtime.pipeline.schedule import check_schedule, chunk_ranks
from sbp_core.sbp import Broadcast, Partial, Split

_SBP = re.compile(r"^(?:S\((\d+)\)|B|P\((sum|max|min)\))$")


def parse_sbp(text: str):
    """``"S(1)"`` -> ``Split(1)``, ``"B"`` -> ``Broadcast()``, ``"P(sum)"`` -> ``Partial("sum")``."""
    m = _SBP.match(str(text).strip())
    if m is None:
        raise ValueError(f"SBP {text!r} is not one of S(<dim>), B, P(sum|max|min)")
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    if m.group(2) is not None:
        return Partial(m.group(2))
    return Broadcast()


@dataclass(frozen=True)
class Strategy:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    ops: tuple = field(default_factory=tuple)  # sorted ((pattern, "S(1)"|"S(0)"|"B"), ...)
    schedule: str = "1f1b"
    virtual: int = 1

    def __post_init__(self):
        for k in ("dp", "tp", "pp", "micro_batch_size", "virtual"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Strategy.{k}={v!r}: must be an int >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Strategy.zero={self.zero!r}: must be one of 0, 1, 2, 3")
        check_schedule(self.schedule, self.pp, self.virtual)
        for pattern, sbp in self.ops:
            parse_sbp(sbp)
        ops = tuple(sorted((str(p), str(s)) for p, s in self.ops))
        if self.tp == 1:  # a one-device tp axis lays everything out B: per-op layouts and sequence parallel are moot
            ops = ()
            object.__setattr__(self, "sequence_parallel", False)
        object.__setattr__(self, "ops", ops)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages (model chunks): ``virtual`` on each of the ``pp`` pipeline ranks."""
        return self.pp * self.virtual

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank (0..pp-1) that holds stage ``stage`` (``runtime.pipeline.schedule.chunk_ranks``)."""
        return chunk_ranks(self.schedule, self.pp, self.virtual)[stage]

    @property
    def name(self) -> str:
        """``dpX_tpY_ppZ`` (with ``_zeroK`` when ZeRO is on): a layout name ``train.py parallel=`` accepts."""
        base = f"dp{self.dp}_tp{self.tp}_pp{self.pp}"
        return base + (f"_zero{self.zero}" if self.zero else "")

    def describe(self) -> str:
        extras = [f"micro-batch {self.micro_batch_size}"]
        if self.pp > 1:
            extras.append(f"{self.schedule}" + (f" x{self.virtual} stages per rank" if self.virtual > 1 else ""))
        if self.sequence_parallel:
            extras.append("sequence parallel")
        if self.ops:
            extras.append(f"{len(self.ops)} op override(s)")
        return f"{self.name} ({', '.join(extras)})"

    def with_op(self, pattern: str, sbp: str | None) -> "Strategy":
        """This strategy with ``pattern``'s tp-axis SBP set (``None``: back to the recipe's)."""
        ops = {p: s for p, s in self.ops if p != pattern}
        if sbp is not None:
            ops[pattern] = sbp
        return replace(self, ops=tuple(ops.items()))

    def op_overrides(self) -> dict:
        """``{pattern: (B, tp SBP)}`` for a ``(dp, tp)`` mesh plan."""
        return {p: (Broadcast(), parse_sbp(s)) for p, s in self.ops}

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero,
                "micro_batch_size": self.micro_batch_size, "sequence_parallel": self.sequence_parallel,
                "ops": {p: s for p, s in self.ops}, "schedule": self.schedule, "virtual": self.virtual}

    @classmethod
    def from_name(cls, name: str, micro_batch_size: int = 1) -> "Strategy":
        """The strategy of a layout name like ``dp8_tp2_pp2_zero1``; a context-parallel name (``cp2``) is refused:
        the search and the simulator lay out dp, tp and pp only."""
        from toolkit.config import parse_parallel_name

        d = parse_parallel_name(name)
        if d["cp"] != 1:
            raise ValueError(f"layout {name!r}: the simulator lays out dp, tp and pp only, not cp={d['cp']}")
        return cls(d["dp"], d["tp"], d["pp"], d["zero"], micro_batch_size=micro_batch_size)

    @classmethod
    def from_dict(cls, d: dict) -> "Strategy":
        known = {"dp", "tp", "pp", "zero", "micro_batch_size", "sequence_parallel", "ops", "schedule", "virtual"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"strategy keys {unknown} are unknown; valid: {sorted(known)}")
        d = dict(d)
        d["ops"] = tuple((d.get("ops") or {}).items())
        return cls(**d)
