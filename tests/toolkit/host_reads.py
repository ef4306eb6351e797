"""A probe for the ops that make a CUDA host wait for the device, counted on any device.

``with HostReads() as reads: ...`` counts, on the calling thread, the ops
whose result the host needs (``.item()``, ``float(t)``, ``bool(t)``,
``nonzero``, ``unique``, sparse ``coalesce``, ...), boolean-mask indexing
(a hidden ``nonzero``) and ``repeat_interleave`` without ``output_size``:
``reads.ops`` by op, ``reads.sites`` by op and calling line (the innermost
frame outside torch). Copies to the host (``.cpu()``, ``.tolist()``) are
not ops it can see on a CPU tensor.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
                   "aten::argwhere", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive", "aten::_coalesce", "aten::bincount"})
MASKED = frozenset({"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"})
_TORCH = os.path.dirname(torch.__file__) + os.sep


class HostReads(TorchDispatchMode):
    """Counts the ops that make a CUDA host wait, by op and by calling line (the innermost frame outside torch)."""

    def __init__(self):
        super().__init__()
        self.ops, self.sites = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        masks = args[1] if name in MASKED and len(args) > 1 else ()
        if (name in READS or any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks)
                or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None)):
            self.ops[name] += 1
            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(_TORCH))
            self.sites[f"{name} at {os.path.basename(frame.filename)}:{frame.lineno}"] += 1
        return func(*args, **kwargs)
