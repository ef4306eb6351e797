"""Op signature rules: for each aten op, the SBP signatures it accepts.

A *rule* receives a ``Call`` (input metadata, the call's arguments with
global tensors replaced by ``TensorMeta``, and the size ``p`` of one mesh
axis) and returns the 1-d signatures valid on that axis, best first. An N-d
signature is one 1-d signature per mesh axis; the dispatcher builds them as
products and picks the cheapest by boxing cost.

An entry may also name:

- ``local``: how to run the op on local shards for a chosen signature when
  plain ``func(*locals)`` would be wrong (e.g. vocab-parallel embedding
  masks the ids outside its shard);
- ``decompose``: a function of the call's global tensors that computes the
  op from other ops, used when ``decompose_when`` says the layouts need it
  (e.g. log-softmax over a split class axis becomes local max, ``P(max)``,
  local exp-sum, ``P(sum)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch


class TensorMeta(NamedTuple):
    """What a rule may know about a global tensor input."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Sig(NamedTuple):
    """A 1-d signature: one SBP per tensor input (``None``: any, left as is) and per tensor output."""

    inputs: tuple
    outputs: tuple


@dataclass
class Call:
    """One op call as a rule sees it."""

    func: object
    args: tuple
    kwargs: dict
    metas: list  # TensorMeta per global tensor input, in flattened argument order
    p: int = 1  # size of the mesh axis being decided
    axis: int = 0  # which mesh axis is being decided
    mesh_shape: tuple = (1,)
    sbps: list = field(default_factory=list)  # the inputs' actual N-d SBP

    def actual(self, j: int):
        """Input ``j``'s actual SBP on the axis being decided."""
        return self.sbps[j][self.axis] if self.sbps else None

    def partial_here(self, *inputs) -> bool:
        """True when one of ``inputs`` (all if none given) is partial on this axis."""
        idx = inputs or range(len(self.metas))
        return any((s := self.actual(j)) is not None and s.is_partial for j in idx)

    def arg(self, index: int, name: str, default=None):
        """Positional-or-keyword argument of the op's schema."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass
class OpEntry:
    rule: Callable
    local: Callable | None = None
    decompose: Callable | None = None
    decompose_when: Callable | None = None
    names: list = field(default_factory=list)


_RULES: dict = {}
_TAG_RULES: dict = {}


def register(*ops, local=None, decompose=None, decompose_when=None):
    """Decorator: ``@register(aten.mm.default)`` on a rule function."""

    def deco(rule):
        entry = OpEntry(rule, local, decompose, decompose_when)
        for op in ops:
            _RULES[op] = entry
        return rule

    return deco


def register_tag(tag, rule, local=None):
    """Rule for every op carrying ``tag`` (e.g. ``torch.Tag.pointwise``) with no rule of its own."""
    _TAG_RULES[tag] = OpEntry(rule, local)


def lookup(func) -> "OpEntry | None":
    entry = _RULES.get(func)
    if entry is not None:
        return entry
    for tag in func.tags:
        entry = _TAG_RULES.get(tag)
        if entry is not None:
            return entry
    return None
