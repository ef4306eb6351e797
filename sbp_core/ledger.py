"""Communication ledger: every collective and transfer, with the bytes it sends.

``record`` is called by the one choke point, ``boxing.collectives``. Bytes
are what this rank *sends* under the algorithm named by ``op`` (ring
all-reduce, direct reduce-scatter/all-gather/all-to-all, point-to-point), so
summing a record's bytes over ranks gives the docs/design.md cost table.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Record:
    """``ranks``: the global ranks taking part, in mesh-axis order (sender first for a ``send``)."""

    op: str
    group_size: int
    bytes: int
    ranks: tuple = ()


@dataclass
class CommLedger:
    records: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def by_op(self) -> dict:
        out: dict = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + r.bytes
        return out


_active: list = []


def record(op: str, group_size: int, nbytes: int, ranks=()) -> None:
    if _active:
        rec = Record(op, group_size, int(nbytes), tuple(ranks))
        for ledger in _active:
            ledger.records.append(rec)


@contextlib.contextmanager
def comm_ledger():
    """``with sc.comm_ledger() as L:`` collects this rank's communication in ``L``."""
    ledger = CommLedger()
    _active.append(ledger)
    try:
        yield ledger
    finally:
        _active.remove(ledger)
