"""Which pipeline stages run on plain tensors: one device, or pure data parallel once audited.

A stage runs its forwards and backwards on plain tensors (its module's
global parameters swapped for leaves, ``sc.LocalParameters``) when its ops
on global tensors would only repeat, with host time per op, what the same
ops do on the locals:

- **One device** (``sc.runs_local``): every signature is the plain one;
  values are the dispatched path's bit for bit.
- **Pure data parallel over n devices** (``replicas`` returns n): every
  parameter and buffer ``B`` on every mesh axis, every batch field (and
  boundary activation) ``S(0)`` on every mesh axis of size > 1 with rows
  divisible by n, no sparse gradients, not ZeRO, and the recipe declares
  that its loss is a mean in which every row weighs the same
  (``Recipe.rows_weigh_equally``, ``PipelineConfig``). Each rank then
  computes its own rows of every activation, as the dispatched ``S(0)``
  signatures do, and the last stage's plain loss (its rows' mean) divided
  by n is the dispatched loss's partial value (its rows' sum over the
  global count, ``sbp_core.ops.loss``). Its gradients are each replica's
  partial sums (``P``), handed to the parameters at the step's reduce and
  all-reduced there by ``box_grads`` — one coalesced collective after
  backward instead of buckets overlapping it.

  What couples rows in the forward would break this: BatchNorm's batch
  statistics (global on the dispatched path), dropout's mask (drawn for the
  global shape), a sum instead of a mean. So the first training step's
  first micro-batch is an **audit** (``audit``): each rank runs the stage
  forward on both paths from the same RNG state and compares the stage's
  output (its local rows; on the last stage the loss partial); the stage's
  ranks agree on the verdict by one ``P(max)`` scalar boxed to ``B``.
  Passed, every later step and evaluation runs plain; failed, the stage
  stays dispatched for the step object's life. Both verdicts are exact
  runs of the same model: the audit only chooses the faster one.

``explain`` still sees every op: while it records, ``plain`` is false.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core import GlobalTensor, Layout
from sbp_core.dispatch import explaining
from sbp_core.sbp import Partial, Split

from .boundary import as_tuple

AUDIT_RTOL = 1e-5  # the float32 parity bar for a stage's outputs and loss (scripts/verify_parity.py's)
_S0 = Split(0)


def replicas(cfg, rank: int, module, zero=None) -> int:
    """n > 1 when pipeline rank ``rank``'s stages may run plain as pure data parallel over n devices (module
    docstring), else 0; never under ZeRO (``zero``: its strategy object, or ``None``)."""
    p = cfg.placements[rank]
    if p.size == 1 or not cfg.rows_weigh_equally or zero is not None \
            or not sc.replicated(module):
        return 0
    sbps = [cfg.data_sbp] + ([cfg.act_sbp] if len(cfg.placements) > 1 else [])
    if any(n > 1 and s != _S0 for sbp in sbps for n, s in zip(p.shape, sbp)):
        return 0
    rows = [shape[0] for shape, _ in cfg.batch.values()] + [shape[0] for acts in cfg.acts for shape, _ in acts]
    if any(r % p.size for r in rows):
        return 0
    return p.size


def plain(placement, audited: bool) -> bool:
    """Does the stage on ``placement`` run its next step on plain tensors?"""
    return sc.runs_local(placement) or (audited and not explaining())


def loss_value(total: torch.Tensor, placement) -> torch.Tensor:
    """The whole loss from each replica's partial ``total`` (a ``P(sum)`` scalar boxed to ``B``: one all-reduce)."""
    return GlobalTensor(total, Layout(placement, (Partial("sum"),) * placement.ndim, (), total.dtype)).full_tensor()


def _rng_state(device_type: str) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if device_type == "cuda" else None)


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _close(theirs: torch.Tensor, mine: torch.Tensor) -> bool:
    if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
        return False
    if not theirs.is_floating_point():
        return bool(torch.equal(theirs, mine))
    return bool((theirs - mine).abs().max() <= AUDIT_RTOL * torch.maximum(theirs.abs().max(), mine.abs().max()))


def audit(dispatched, plain_forward, placement, n: int, last: bool):
    """``(dispatched's result, passed)``: the audit of a data-parallel stage's first micro-batch.

    Runs ``dispatched()`` (a stage forward on global tensors, returning its
    ``Stash``) and ``plain_forward()`` (the same on plain tensors, no grad;
    on the ``last`` stage its loss already divided by the ``n`` replicas)
    from one RNG state, both eager (a compiled forward runs as written), compares their outputs on every rank of
    ``placement`` within ``AUDIT_RTOL`` and agrees on the verdict (one
    scalar ``P(max) -> B`` box: an all-reduce over the stage). The RNG state
    afterwards is the dispatched run's.
    """
    before = _rng_state(placement.device_type)
    st = dispatched()
    after = _rng_state(placement.device_type)
    _set_rng_state(before)
    try:
        # Eager, as the dispatched side: a compiled forward (``trainer.compile``) fuses bf16 kernels and
        # rounds otherwise, beyond the bar, though both paths are the same model.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            mine = plain_forward().output
    finally:
        _set_rng_state(after)
    out = st.output
    if last:
        wide = [s for k, s in zip(placement.shape, out.sbp) if k > 1]  # an axis of one device: any SBP is whole
        if all(s.is_partial and s.op == "sum" for s in wide):
            theirs = out._local.detach()
        elif all(s.is_broadcast for s in wide):
            theirs = out._local.detach() / n
        else:
            theirs = None
    else:  # the boundary's tensors, laid out act_sbp: S(0) on every axis of size > 1 (``replicas``)
        theirs = tuple(t._local.detach() for t in out)
    ok = theirs is not None and all(_close(a, b) for a, b in zip(as_tuple(theirs), as_tuple(mine)))
    flag = torch.tensor(0.0 if ok else 1.0, device=placement.device())
    verdict = GlobalTensor(flag, Layout(placement, (Partial("max"),) * placement.ndim, (), flag.dtype)).full_tensor()
    return st, float(verdict) == 0.0
