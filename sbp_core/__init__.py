"""sbp_core: global tensors laid out by SBP over a placement, and boxing between layouts.

Public API (OneFlow-like names)::

    import sbp_core as sc
    from sbp_core import sbp
    p = sc.placement("cpu", ranks=[[0, 1], [2, 3]])
    w = sc.randn(8, 6, placement=p, sbp=(sbp.broadcast, sbp.split(1)))
    x = sc.to_global(local, placement=p, sbp=(sbp.split(0), sbp.broadcast))
    y = x.to_global(placement=p2, sbp=sbp.broadcast)
    y.to_local(); y.full_tensor(); y.placement; y.sbp
    with sc.comm_ledger() as ledger: ...

Imports nothing of this project but itself (docs/design.md layers).
"""
from . import ops, sbp  # noqa: F401  (ops registers the signature rules)
from .boxing.cost import disjoint as disjoint_cost, same_placement as same_placement_cost
from .boxing.nd_plan import plan as boxing_plan
from .cast import cast, cast_group, cast_many, remat_saved
from .creation import ones, rand, randn, zeros
from .declare import distribute, to_global
from .boxing import methods as _boxing_methods  # noqa: F401  (sets GlobalTensor's to_local/to_global/full_tensor)
from .dispatch import explain, format_explain  # (and sets GlobalTensor.__torch_dispatch__)
from .global_tensor import GlobalTensor, NoSbpRule
from .sparse import SparseGlobalTensor
from .grad_clip import clip_grad_norm_, clip_local_
from .loss_scale import LossScaler
from .module import box_grads, defer_grad_boxing, describe_plan, distribute_module, planned_sbp
from .one_device import LocalParameters, replicated, runs_local
from .local_step import step_on_locals, steps_on_locals, takes_local_grads
from .layout import Layout
from .ledger import CommLedger, comm_ledger
from .placement import Placement, placement
from .process_groups import get_timeout, initialising, set_init_timeout, set_timeout

__all__ = [
    "sbp", "placement", "cast", "SparseGlobalTensor", "cast_group", "cast_many", "remat_saved", "Placement", "GlobalTensor", "Layout", "NoSbpRule",
    "to_global", "distribute", "randn", "rand", "zeros", "ones",
    "comm_ledger", "CommLedger", "explain", "format_explain", "set_timeout", "get_timeout",
    "set_init_timeout", "initialising",
    "boxing_plan", "clip_grad_norm_", "clip_local_", "LossScaler", "distribute_module", "planned_sbp", "describe_plan", "defer_grad_boxing", "box_grads", "same_placement_cost", "disjoint_cost",
    "LocalParameters", "replicated", "runs_local", "step_on_locals", "steps_on_locals", "takes_local_grads",
]
