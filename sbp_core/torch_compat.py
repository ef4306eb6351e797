"""The torch APIs sbp_core uses that are newer than the oldest torch it runs on (2.11), with fallbacks.

Each name here is read from torch when the running release has it, and
otherwise computed from what 2.11 has, with the same meaning.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_INPLACE_TAG = getattr(torch.Tag, "inplace", None)  # torch >= 2.12


def is_inplace(func) -> bool:
    """Whether the aten overload ``func`` writes into its first argument and returns it (``add_``, ``copy_``).

    ``torch.Tag.inplace`` says so from 2.12 on; before, the schema does: a
    positional first argument, a tensor or a list of them, marked written
    (``Tensor(a!) self``, ``Tensor(a!)[] self``). On torch 2.13 the two agree on
    every aten overload but six TorchScript-only or internal ones, none of
    which a global tensor reaches.
    """
    if _INPLACE_TAG is not None:
        return _INPLACE_TAG in func.tags
    args = func._schema.arguments
    if not args or args[0].kwarg_only or not _holds_tensors(args[0].type):
        return False
    alias = args[0].alias_info
    return alias is not None and alias.is_write


def _holds_tensors(kind) -> bool:
    return isinstance(kind, torch.TensorType) or (
        isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType))
