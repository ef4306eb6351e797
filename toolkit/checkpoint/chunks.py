"""Global tensors in DCP's chunk protocol: each rank saves and loads its own box.

``torch.distributed.checkpoint`` asks a tensor three things through duck
typing (``planner_helpers._create_write_items``, ``_create_chunk_list`` and
``utils.find_tensor_shard`` check ``hasattr``): which chunks it writes
(``__create_write_items__``), which chunks it needs on load
(``__create_chunk_list__``) and the local data of a chunk
(``__get_tensor_shard__``). A chunk is a box ``(offsets, sizes)`` of the
global tensor: exactly what ``sbp_core.layout.local_box`` gives for a rank's
S/B shard, uneven ``tensor_split`` pieces and nested N-d splits included.
DCP then does the rest: replicas of one box (``B`` axes) have the same
chunk index and are written once (``dedup_save_plans`` keeps the replica on
the least loaded rank), and on load it intersects each box a rank needs
with the saved boxes, so any layout reads any other.

:class:`ShardView` adds these three methods to a ``GlobalTensor`` that
shares the original's local tensor (no copy): ``GlobalTensor`` itself does
not define them and this package leaves ``sbp_core`` unchanged (defining
them there would make the view unnecessary). Partial (``P``) axes are no
box: :func:`reduce_partial` reduces them before saving (``P -> B``), and on
load only the rank whose partial coordinates are all zero reads the value
while the others take the reduction's identity (``sbp_core``'s ``B -> P``
convention).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from sbp_core import GlobalTensor, Layout
from sbp_core.layout import filler_op, local_box, reduce_identity
from sbp_core.sbp import Broadcast, format_sbp

from . import _dist


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU and contiguous: the bytes ``storage.Writer`` writes as they are."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


class ShardView(GlobalTensor):
    """A ``GlobalTensor`` view (same local, same layout) that DCP saves and loads box by box.

    ``_ckpt_data``: the local tensor DCP reads from (save) or copies into
    (load); ``_ckpt_box``: this rank's box, or ``None`` when the rank holds no
    part of the value (outside the placement, or a partial axis' filler).
    """

    _ckpt_data: torch.Tensor
    _ckpt_box: tuple | None

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(s for s, _ in self._ckpt_box),
                                    sizes=torch.Size(n for _, n in self._ckpt_box))

    def __create_write_items__(self, fqn: str, obj) -> list:
        if self._ckpt_box is None:
            return []
        chunk = self._chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=self.dtype), size=self.shape),
        )]

    def __create_chunk_list__(self) -> list:
        return [] if self._ckpt_box is None else [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if self._ckpt_box is None or index.offset != self._chunk().offsets:
            raise ValueError(f"{index.fqn}: rank {_dist.rank()} holds no chunk at offsets {index.offset}")
        return self._ckpt_data


def _view(local: torch.Tensor, layout: Layout, data: torch.Tensor, box) -> ShardView:
    view = ShardView(local, layout)
    view._ckpt_data = data
    view._ckpt_box = box
    return view


def _box(layout: Layout, me: int):
    if me not in layout.placement:
        return None
    coords = layout.placement.coords(me)
    box = local_box(layout.shape, layout.placement.shape, layout.sbp, coords)
    if any(n == 0 for _, n in box) and layout.shape.numel() > 0:
        return None  # an empty piece of a non-empty tensor: nothing to write or read
    return box


def reduce_partial(t: GlobalTensor) -> GlobalTensor:
    """``t`` with every partial axis reduced (``P -> B``); collective over ``t``'s placement."""
    if not any(s.is_partial for s in t.sbp):
        return t
    with torch.no_grad():
        return t.to_global(sbp=tuple(Broadcast() if s.is_partial else s for s in t.sbp))


def for_save(t: torch.Tensor) -> torch.Tensor:
    """What DCP is given to save ``t``: a :class:`ShardView` for a global tensor (partial axes
    already reduced), the compacted tensor itself for a plain one (replicated: written once)."""
    if not isinstance(t, GlobalTensor):
        return compact(t)
    me = _dist.rank()
    box = _box(t.layout, me)
    if box is not None and t.shape.numel() == 0 and t.placement.ranks[0] != me:
        box = None  # an empty tensor still needs one (empty) chunk in the metadata
    data = compact(t._local) if box is not None else t._local
    return _view(t._local, t.layout, data, box)


def for_load(t: torch.Tensor) -> torch.Tensor:
    """What DCP is given to fill ``t`` in place: a :class:`ShardView` over ``t``'s own local tensor."""
    if not isinstance(t, GlobalTensor):
        return t
    me = _dist.rank()
    box = _box(t.layout, me)
    if box is not None and filler_op(t.sbp, t.placement.coords(me)) is not None:
        box = None
    return _view(t._local, t.layout, t._local, box)


def finish_load(t: torch.Tensor) -> None:
    """After DCP filled the boxes: a partial axis' other ranks take the reduction's identity."""
    if isinstance(t, GlobalTensor) and _dist.rank() in t.placement:
        op = filler_op(t.sbp, t.placement.coords(_dist.rank()))
        if op is not None:
            with torch.no_grad():
                t._local.fill_(reduce_identity(op, t.dtype))


def describe(t: torch.Tensor) -> tuple:
    """What other ranks need to know of this rank's tensor to decide who writes it:
    ``(kind, placement ranks, shape, dtype, holds data here, mesh shape, sbp)``."""
    if isinstance(t, GlobalTensor):
        return ("global", tuple(t.placement.ranks), tuple(t.shape), str(t.dtype), _dist.rank() in t.placement,
                tuple(t.placement.shape), format_sbp(t.sbp))
    return ("plain", None, tuple(t.shape), str(t.dtype), True, None, None)


def same_data_key(t: torch.Tensor):
    """A key equal for two tensors that are views of the same data (tied parameters), else ``None``."""
    local = t._local if isinstance(t, GlobalTensor) else t
    if local.numel() == 0:
        return None
    layout = t.layout if isinstance(t, GlobalTensor) else None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype, layout)
