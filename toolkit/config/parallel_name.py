"""Parallel layout names such as ``dp2_tp4_pp2_zero1``: parsing and the canonical spelling.

Grammar: ``single``, or parts joined by ``_`` in any order, each at most once:

- ``dpN`` data-parallel degree, ``cpN`` context-parallel degree (the
  sequence split), ``tpN`` tensor-parallel degree, ``ppN`` pipeline-parallel
  degree (``N`` a positive integer);
- ``zeroK`` ZeRO stage ``K`` in 0..3.

Missing parts take their neutral value (degree 1, ZeRO 0), so ``tp2`` is
``dp1_cp1_tp2_pp1_zero0``. The canonical name (:func:`parallel_name`) lists the
parts that differ from neutral in the order dp, cp, tp, pp, zero, or ``single``.
"""
from __future__ import annotations

import re

from toolkit.config.errors import ConfigError

#: Neutral value of every part; a name sets a subset of these keys.
NEUTRAL = {"dp": 1, "cp": 1, "tp": 1, "pp": 1, "zero": 0}
ZERO_STAGES = (0, 1, 2, 3)
_PART = re.compile(r"^(dp|cp|tp|pp|zero)(\d+)$")
_VALID = ("'single', or parts dpN, cpN, tpN, ppN (N >= 1) and zeroK (K in 0..3) joined by '_' "
          "in any order, each at most once, e.g. dp2_tp4_pp2 or dp4_zero2")


def parse_parallel_name(name: str) -> dict[str, int]:
    """``"dp2_tp4_pp2_zero1"`` -> ``{"dp": 2, "cp": 1, "tp": 4, "pp": 2, "zero": 1}`` (all five keys).

    Raises :class:`ConfigError` naming the malformed part and the grammar.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"parallel={name!r}: a parallel layout name must be a non-empty string; "
                          f"valid: {_VALID}")
    if name == "single":
        return dict(NEUTRAL)
    out = dict(NEUTRAL)
    seen: set[str] = set()
    for part in name.split("_"):
        m = _PART.match(part)
        if m is None:
            hint = ""
            if re.fullmatch(r"dp|cp|tp|pp|zero", part):
                hint = f" (the part {part!r} lacks its number)"
            raise ConfigError(f"parallel={name!r}: part {part!r} is not a layout part{hint}; "
                              f"valid: {_VALID}")
        key, value = m.group(1), int(m.group(2))
        if key in seen:
            raise ConfigError(f"parallel={name!r}: part {key!r} appears twice; valid: {_VALID}")
        seen.add(key)
        if key == "zero":
            if value not in ZERO_STAGES:
                raise ConfigError(f"parallel={name!r}: ZeRO stage {value} does not exist; "
                                  f"valid: zero0, zero1, zero2 or zero3")
        elif value < 1:
            raise ConfigError(f"parallel={name!r}: degree {key}{value} must be at least 1; "
                              f"valid: {_VALID}")
        out[key] = value
    return out


def parallel_name(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, cp: int = 1) -> str:
    """The canonical layout name: ``parallel_name(2, 1, 2)`` -> ``"dp2_pp2"``; all neutral -> ``"single"``."""
    parts = [f"{k}{v}" for k, v in (("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp)) if v != 1]
    if zero:
        parts.append(f"zero{zero}")
    return "_".join(parts) or "single"
