"""The data pipeline as actors: read -> decode -> collate (-> to_device, where there is a copy).

``data_stages`` builds the actors to append to a ``Plan``; the training step
(or any consumer) lists the last one, ``stages[-1].name``, as an input:

- ``{prefix}.read``      queue "data": ``read(piece) -> raw`` (file I/O);
- ``{prefix}.decode``    queue "data": ``decode(piece, raw) -> samples``;
- ``{prefix}.collate``   queue "data": ``collate(piece, samples) -> batch``;
- ``{prefix}.to_device`` queue "copy", only when the device is CUDA: every
  tensor of the (nested dict / list / tuple) batch pinned and copied with
  ``non_blocking=True`` on a side stream that overlaps the step's compute
  (``to_device``). With nothing to copy there is no such actor (it
  would hand each batch on unchanged: on a CPU-only host one more action
  and two more messages per batch on the compute thread, where its actions
  alone took 0.72-0.80 ms of a 60-batch loop of ``scripts/bench_dataloader.py``
  in place (six loops); on a thread of its own, two cross-thread messages
  per batch, ~35 us of CPU each on a 2-core VM).

Each stage owns ``quota`` out registers, so at most ``quota`` raw reads,
decoded sample lists, batches and device batches are alive per stage, and a
slow step stops the reader (back pressure) instead of prefetching without
bound. The data and copy queue threads of the executor run these actors
alongside the compute thread, and on a host without an accelerator the
compute thread runs them itself between its own actions
(``runtime.executor.thread_homes``: there a data thread would only take the
GIL from the step). These actors live within one run (one training step);
loading and copying the next step's batches while the device still works on
this one is ``toolkit.data.ReadAhead``'s, whose worker threads call
``to_device`` themselves (``toolkit.data.MicroBatches`` then hands the step
its batches with one compute actor instead of these). An exception in a
stage stops the run and names the stage's actor and the piece (batch index).
"""
from __future__ import annotations

import torch

from sbp_core.boxing.collectives import block_until_done

from .plan import ActorSpec

STAGES = ("read", "decode", "collate", "to_device")


def copies_to(device) -> bool:
    """Whether ``to_device`` copies batches to ``device`` (CUDA) rather than returning them as they are."""
    return device is not None and torch.device(device).type == "cuda"


_COPY_STREAMS: dict = {}  # device -> the side stream host-to-device copies run on


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The process's one host-to-device copy stream for CUDA ``device`` (created on first use)."""
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def to_device(batch, device):
    """``batch`` with every tensor moved to ``device`` (dicts, lists, tuples recursed).

    CUDA: each tensor is pinned (``pin_memory()``) and copied with
    ``non_blocking=True`` on a side stream (``copy_stream``), so the copy of
    batch ``k + 1`` runs while the compute stream works on batch ``k``;
    nothing is ever queued on the compute stream. The copies' memory is
    marked as used by the device's default stream, where the step computes
    (``record_stream``: the allocator will not reuse it for the next batch
    before that stream is done with it). The calling thread (the copy queue's,
    or a read-ahead worker) then waits for the copies on the host, so a batch
    handed on is on the device already and the compute stream needs no event
    to wait on. Any other device or ``None``: returns ``batch`` itself, no
    copy.
    """
    if not copies_to(device):
        return batch
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream, compute = copy_stream(device), torch.cuda.default_stream(device)
    copied = []

    def move(x):
        if x.device == device:  # decoded on the device already (e.g. by DALI)
            return x
        out = x.pin_memory().to(device, non_blocking=True)
        copied.append(out)
        return out

    with torch.cuda.stream(stream):
        out = _tensors_mapped(batch, move)
    for t in copied:
        t.record_stream(compute)
    if copied:
        block_until_done(stream)
    return out


def _tensors_mapped(batch, fn):
    """``batch`` (nested dicts, lists, tuples) with ``fn`` applied to each tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _tensors_mapped(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_tensors_mapped(v, fn) for v in batch)
    return batch


def data_stages(read, decode, collate, device=None, quota: int = 2, prefix: str = "data") -> list:
    """The pipeline actors, in order; consume ``stages[-1].name``.

    ``read(piece) -> raw``, ``decode(piece, raw) -> samples`` and
    ``collate(piece, samples) -> batch`` run on the "data" queue, and the
    copy to ``device`` on the "copy" queue when there is one (``copies_to``:
    the last actor is then ``f"{prefix}.to_device"``, else
    ``f"{prefix}.collate"``); every stage has ``quota`` out registers.
    Piece ``k`` of every stage is batch ``k``: the consumer sees batches in
    order, exactly ``collate(k, decode(k, read(k)))`` on ``device``.
    """
    def n(stage):
        return f"{prefix}.{stage}"

    stages = [
        ActorSpec(n("read"), read, queue="data", quota=quota),
        ActorSpec(n("decode"), decode, inputs=(n("read"),), queue="data", quota=quota),
        ActorSpec(n("collate"), collate, inputs=(n("decode"),), queue="data", quota=quota),
    ]
    if copies_to(device):
        stages.append(ActorSpec(n("to_device"), lambda piece, batch: to_device(batch, device),
                                inputs=(stages[-1].name,), queue="copy", quota=quota))
    return stages
