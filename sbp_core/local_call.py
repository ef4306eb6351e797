"""The cheapest callable that runs an aten op overload on local tensors.

``func(*args)`` on an ``OpOverload`` goes through a Python ``__call__`` and
the JIT's boxed calling convention (arguments matched against the schema as
``IValue``s): about 3.5k more instructions than the op's Python binding
(``torch.Tensor.add``, ``torch.native_layer_norm``), whose parser calls the
kernel unboxed, and 5.5k more for ``view`` (callgrind, torch 2.13). The
dispatcher calls the local op once per global op, so it uses the binding when
one provably runs the same overload: once per decision, the binding is
dry-run on the decision's meta arguments under a dispatch mode that records
the ops reaching the kernels, and it is taken only if that record is exactly
``[func]`` and its outputs have the meta run's shapes, strides and dtypes.
Anything else (no binding of that name, a Python-level wrapper, another
overload, a decomposition) keeps ``func._op``, which is always right.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = (torch._C.TensorBase, torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special)
_BUILTIN = (type(torch._C.TensorBase.add), type(torch._C._VariableFunctions.add))


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _same_outputs(a, b) -> bool:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype):
            return False
    return True


def local_callable(func, meta_args, meta_kwargs, meta_out):
    """``func``'s Python binding if it runs exactly ``func`` on these (meta) arguments, else ``func._op``.

    ``meta_args``/``meta_kwargs`` must be fresh meta tensors (an in-place op
    writes to them); ``meta_out`` is what ``func`` returned on equal ones.
    """
    name = func._opname  # "add_" for aten.add_.Tensor
    first_is_tensor = bool(meta_args) and isinstance(meta_args[0], torch.Tensor)
    for space in _NAMESPACES:
        if space is torch._C.TensorBase and not first_is_tensor:
            continue
        binding = getattr(space, name, None)
        if binding is None or not isinstance(binding, _BUILTIN):
            continue
        rec = _Record()
        try:
            with rec:
                out = binding(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001 - any refusal just means "not this binding"
            continue
        if rec.ops == [func] and _same_outputs(out, meta_out):
            return binding
    return func._op
