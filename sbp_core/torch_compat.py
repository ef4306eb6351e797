"""The torch APIs sbp_core uses that are newer than the oldest torch it runs on (2.11), with fallbacks.

Each name here is read from torch when the running release has it, and
otherwise computed from what 2.11 has, with the same meaning. One aten
kernel, the backward of the value-selecting reductions, is replaced by 2.13's
on releases whose kernel builds plain zeros (a probe at import says which;
from 2.13 on it is not run, since the probe's backward under a dispatch mode
imports ``torch._dynamo``, over a second of every process's start-up).
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


def _selection_backward_uses_new_zeros() -> bool:
    """Whether this torch's backward of ``max(dim)`` builds its zeros with ``grad.new_zeros`` (2.13 does)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func)
            return func(*args, **(kwargs or {}))

    # One intra-op thread: a reduction would otherwise start torch's thread pool, and importing sbp_core must
    # leave none behind (a fork server imports it, toolkit.child.host_rank_context, and forks ranks that then
    # use their own).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode(False), torch.enable_grad():  # whatever the importing code runs under
            x = torch.zeros(2, 2, device="cpu", requires_grad=True)
            values = x.max(0)[0]
            with _Seen() as seen:
                values.sum().backward()
    finally:
        torch.set_num_threads(threads)
    return torch.ops.aten.new_zeros.default in seen.ops


def _value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim):
    """torch 2.13's backward of ``max``/``min`` over a dim, ``topk``, ``sort``, ``kthvalue``, ``median``, ``mode``.

    Scatters ``grad`` at ``indices`` into zeros of the input's ``sizes``.
    Older releases make those zeros with ``torch.zeros``: a plain tensor,
    which a global gradient cannot be scattered into. ``grad.new_zeros`` makes
    them global (the dispatcher's ``new_zeros`` rule), as 2.13 does.
    """
    if not keepdim and len(sizes) > 0:
        grad, indices = grad.unsqueeze(dim), indices.unsqueeze(dim)
    return grad.new_zeros(sizes).scatter(dim, indices, grad)


_aten_overrides = None  # the Library that holds the kernels below, kept alive: its registrations end with it
# A pre-release of 2.13 (2.13.0a0+git...) sorts below 2.13.0 and is probed: it may predate the kernel's change.
if torch.torch_version.TorchVersion(torch.__version__) < "2.13.0" and not _selection_backward_uses_new_zeros():
    import warnings

    _aten_overrides = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the override is the point
        warnings.simplefilter("ignore")
        _aten_overrides.impl("value_selecting_reduction_backward", _value_selecting_reduction_backward,
                             "CompositeImplicitAutograd")
