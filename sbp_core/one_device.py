"""A module on a one-device placement runs on plain tensors: its global parameters' locals as leaves.

On a placement of one device every SBP is trivial: the local tensor is the
whole global tensor, every op takes its plain signature (run the op on the
local, wrap the output) and nothing is communicated. Dispatching each op
through ``GlobalTensor.__torch_dispatch__`` then adds only host time, about
5 µs an op over plain torch's 1.7 µs (``scripts/bench_dispatch.py``), which a
pipeline stage pays for every op of every micro-batch's forward and
backward. ``runs_local(placement)`` says when a caller may skip it;
``LocalParameters(module)`` does the skipping:

- ``swap()`` puts in the module, for each global parameter, a plain leaf
  tensor sharing the parameter's local storage (so the optimizer's in-place
  updates of the global parameter are what the next forward reads) and, for
  each global buffer, its local. Tied parameters (one object under two
  names) get one leaf. Autograd accumulates the micro-batches' gradients in
  the leaves in C++ (no dispatch).
- ``restore()`` puts the global parameters and buffers back and hands each
  leaf's gradient to its parameter as a global tensor in the parameter's
  layout — which on one device is every layout the dispatched path could
  have produced (``B``: one device has no partial to reduce) — or, for a
  sparse COO gradient, a ``SparseGlobalTensor`` laid out ``sparse_sbp_for``.
  ``restore(hand_grads=False)`` leaves the gradients on the leaves instead,
  for an update that needs nothing global of them (one device, one stage,
  an optimizer that takes them: ``runtime.pipeline.step``), which then clips
  and steps the locals with them and drops them (``grads``, ``drop_grads``);
  sparse ones too with ``hold_sparse`` (lazy Adam's row gradients).

Values are the dispatched path's bit for bit: the same aten ops run on the
same locals. Not ``torch.func.functional_call``: it swaps per call, so an
activation-checkpointed layer recomputed in backward (outside the call)
would see the global parameters again, and a pipeline would pay the swap
per micro-batch instead of once per step.

While ``sc.explain()`` records, ``runs_local`` is false, so ``explain``
still lists every op of the stage (trivial signatures, zero boxing). The
communication ledger loses nothing: ops on one device never communicate.
"""
from __future__ import annotations

import torch
from torch import nn

from .dispatch import explaining
from .global_tensor import GlobalTensor, wrap
from .sbp import Partial
from .sparse import SparseGlobalTensor, sparse_sbp_for

_PSUM = Partial("sum")


def runs_local(placement) -> bool:
    """May work on ``placement`` skip op dispatch? One device, and ``explain`` is not recording."""
    return placement.size == 1 and not explaining()


def replicated(module: nn.Module) -> bool:
    """Is every parameter and buffer of ``module`` a global tensor ``B`` on every mesh axis, with no sparse
    gradients (``nn.Embedding(sparse=True)``)? Then each device may run its own rows on ``LocalParameters(
    module, partial=True)`` — where the loss and the forward allow (``runtime.pipeline.plain_stage``)."""
    for t in (*module.parameters(), *module.buffers()):
        if not isinstance(t, GlobalTensor) or not all(s.is_broadcast for s in t.sbp):
            return False
    return not any(getattr(m, "sparse", False) is True for m in module.modules())


def _partial_layout(layout):
    """``P(sum)`` on every mesh axis of more than one device (an axis of one keeps its SBP: one collective kind)."""
    return layout.with_sbp(tuple(_PSUM if n > 1 else s for n, s in zip(layout.placement.shape, layout.sbp)))


class LocalParameters:
    """Swaps ``module``'s global parameters and buffers for plain tensors and back (see the module docstring).

    ``partial=True`` (a stage whose parameters are all ``B`` over several
    devices, each running its own rows of the batch on the leaves,
    ``runtime.pipeline.plain_stage``): ``restore`` hands each gradient over
    as ``P(sum)`` on every mesh axis of more than one device, each replica's share, which the
    caller's ``box_grads`` all-reduces to the parameter's ``B`` as it does
    the dispatched path's partial gradients. Dense gradients only.
    """

    def __init__(self, module: nn.Module, partial: bool = False):
        self.module = module
        self.partial = partial
        self._swapped = None  # ``_table()``'s entries while swapped
        self._leaves = []  # [(global parameter, its leaf)] while swapped
        self._entries = None  # the last swap's entries: its tables, names, global tensors (see _table)
        self._made = {}  # id(global parameter) -> (the parameter, the local its leaf was made from, the leaf)
        self.held = []  # [(global parameter, its leaf)] whose gradients restore(hand_grads=False) left on the leaves

    @property
    def swapped(self) -> bool:
        return self._swapped is not None

    def swap(self) -> None:
        """Plain tensors in place of the global parameters and buffers (no-op if already swapped)."""
        if self._swapped is not None:
            return
        entries = self._table()
        leaves, made = {}, {}
        for table, name, g, is_param in entries:
            if not is_param:
                table[name] = g._local
                continue
            key = id(g)
            if key not in leaves:
                leaves[key] = (g, self._leaf(g, made))
            table[name] = leaves[key][1]
        self._made = made
        self._swapped, self._leaves = entries, list(leaves.values())

    def _table(self) -> list:
        """``[(module's _parameters or _buffers dict, name, global tensor, is a parameter)]`` of every global entry.

        Found by walking the module; a later swap reuses the list while every
        entry still holds its global tensor (the walk, a generator per
        submodule, costs more than the swap itself). So a submodule added
        after the first swap is not seen: the module's structure is fixed
        once it is stepped, as a pipeline's stages are."""
        entries = self._entries
        if entries is not None and all(table.get(name) is g for table, name, g, _ in entries):
            return entries
        entries = []
        for mod in self.module.modules():
            for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
                entries += [(table, name, g, is_param) for name, g in table.items() if isinstance(g, GlobalTensor)]
        self._entries = entries
        return entries

    def _leaf(self, g, made: dict):
        """The leaf for parameter ``g``: last swap's when it was made from ``g``'s current local, else a new one.

        A leaf shares its storage with ``g._local``; it carries no gradient
        between steps (``restore`` hands it over and clears it)."""
        old = self._made.get(id(g))
        if old is not None and old[0] is g and old[1] is g._local and old[2].requires_grad == g.requires_grad:
            leaf = old[2]
            if leaf.grad is not None:  # held by a step that failed before its update: not this step's
                leaf.grad = None
        else:
            leaf = g._local.detach().requires_grad_(g.requires_grad)
        made[id(g)] = (g, g._local, leaf)
        return leaf

    @torch.no_grad()
    def restore(self, hand_grads: bool = True, hold_sparse: bool = False) -> bool:
        """The global parameters and buffers back, each leaf's gradient added to its parameter's (no-op if not
        swapped). ``hand_grads=False``: the gradients stay on the leaves (``held``), for an update that steps
        the locals with them (``sc.step_on_locals(optimizer, grads=...)``), until ``drop_grads`` — unless one
        is sparse (an embedding's row gradient) and not ``hold_sparse`` (the update takes dense ones only),
        when all are handed over. Returns whether the gradients stayed on the leaves."""
        if self._swapped is None:
            return False
        for table, name, g, _ in self._swapped:
            table[name] = g
        if not hand_grads and (hold_sparse or not any(
                leaf.grad is not None and leaf.grad.is_sparse for _, leaf in self._leaves)):
            self.held, self._swapped, self._leaves = self._leaves, None, []
            return True
        for p, leaf in self._leaves:
            grad = leaf.grad
            if grad is None:
                continue
            leaf.grad = None
            if grad.is_sparse:
                if self.partial:
                    raise NotImplementedError("a sparse gradient has no partial layout here: "
                                              "a stage with sparse embeddings stays on the dispatched path")
                grad = SparseGlobalTensor(grad, p.layout.with_sbp(sparse_sbp_for(p.sbp)))
            else:
                layout = _partial_layout(p.layout) if self.partial else p.layout
                # the dispatcher's positional constructor: a gradient per parameter per step
                grad = wrap(grad, layout, layout.strides) if grad.is_contiguous() else GlobalTensor(grad, layout)
            p.grad = grad if p.grad is None else p.grad + grad
        self._swapped, self._leaves = None, []
        return False

    def grads(self) -> dict:
        """``{id(parameter): its leaf's gradient or None}`` of the gradients ``restore(hand_grads=False)`` held."""
        return {id(p): leaf.grad for p, leaf in self.held}

    def drop_grads(self) -> None:
        """The held gradients are done with (the update ran): the leaves let them go."""
        for _, leaf in self.held:
            leaf.grad = None
        self.held = []
