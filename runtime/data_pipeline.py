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
bound. There is no separate prefetch thread: the data and copy queue threads
of the executor run these actors alongside the compute thread, and on a host
without an accelerator the compute thread runs them itself between its own
actions (``runtime.executor.thread_homes``: there a data thread would only
take the GIL from the step). An exception in a stage stops the run and names
the stage's actor and the piece (batch index).

``TokenFile`` is a small file-backed dataset for it: fixed-length sequences of
token ids stored as raw int32/uint16 bytes, read with ``seek``/``read`` and
decoded with ``torch.frombuffer`` (random access, no pickles, no numpy).
"""
from __future__ import annotations

import os

import torch

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
    before that stream is done with it). The calling thread (the copy queue's)
    then waits for the copies on the host, so a batch handed on is on the
    device already and the compute stream needs no event to wait on. Any
    other device or ``None``: returns ``batch`` itself, no copy.
    """
    if not copies_to(device):
        return batch
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream, compute = copy_stream(device), torch.cuda.default_stream(device)
    copied = []

    def move(x):
        if isinstance(x, torch.Tensor):
            if x.device == device:  # decoded on the device already (e.g. by DALI)
                return x
            out = x.pin_memory().to(device, non_blocking=True)
            copied.append(out)
            return out
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        return x

    with torch.cuda.stream(stream):
        out = move(batch)
    for t in copied:
        t.record_stream(compute)
    if copied:
        stream.synchronize()
    return out


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
                                inputs=(n("collate"),), queue="copy", quota=quota))
    return stages


def write_tokens(path: str, tokens: torch.Tensor, dtype=torch.int32) -> None:
    """Write a ``[N, T]`` tensor of token ids to ``path`` as raw ``dtype`` bytes, row-major."""
    t = tokens.to(dtype).contiguous()
    with open(path, "wb") as f:
        f.write(bytes(t.untyped_storage())[: t.numel() * t.element_size()])


class TokenFile:
    """Batches of fixed-length token sequences read from a raw binary file.

    The file holds ``N`` sequences of ``seq_len`` ids of ``dtype`` (int32 or
    uint16), back to back. Batch ``piece`` is sequences
    ``[b * batch_size, (b + 1) * batch_size)`` with ``b = piece % len(self)``
    (so a run may loop over the file). ``read``/``decode``/``collate`` have the
    actor signatures of ``data_stages``; ``self[piece]`` does all three (for a
    map-style ``torch.utils.data.Dataset`` with ``batch_size=None``). The file
    handle is opened lazily per process, so the object pickles to workers.
    """

    def __init__(self, path: str, seq_len: int, batch_size: int, dtype=torch.int32):
        if dtype not in (torch.int32, torch.uint16):
            raise ValueError(f"dtype must be torch.int32 or torch.uint16, got {dtype}")
        self.path, self.seq_len, self.batch_size, self.dtype = path, seq_len, batch_size, dtype
        self.seq_bytes = seq_len * torch.empty((), dtype=dtype).element_size()
        n_seq = os.path.getsize(path) // self.seq_bytes
        self.n_batches = n_seq // batch_size
        if self.n_batches < 1:
            raise ValueError(f"{path}: {n_seq} sequences of {seq_len} tokens, fewer than one batch of {batch_size}")
        self._file, self._pid = None, None

    def __len__(self) -> int:
        return self.n_batches

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_pid": None}

    def _handle(self):
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb", buffering=0), os.getpid()
        return self._file

    def read(self, piece: int) -> bytearray:
        """The raw bytes of batch ``piece``'s sequences (they are contiguous: one seek and one read
        into a fresh writable buffer, which ``decode`` views without copying)."""
        f, first = self._handle(), (piece % self.n_batches) * self.batch_size
        size = self.batch_size * self.seq_bytes
        f.seek(first * self.seq_bytes)
        raw = bytearray(size)
        got = f.readinto(raw)
        if got != size:
            raise IOError(f"{self.path}: short read of batch {piece}: {got} of {size} bytes")
        return raw

    def decode(self, piece: int, raw: bytearray) -> torch.Tensor:
        """The sequences of ``raw`` as int64 token ids, ``[batch_size, seq_len]`` (its rows are the
        samples, already laid out as the batch: ``collate`` copies nothing).

        ``.long()``, not ``.to(torch.int64)``: run between training steps (on
        the compute thread of a CPU-only host) the three calls are cold, and
        ``.to``'s overloads cost ~20 us more to resolve there (in place, 4 runs
        of 60 batches, medians: 55 us against 77 us for the three calls).
        """
        ids = torch.frombuffer(raw, dtype=self.dtype).long()
        return ids.view(self.batch_size, self.seq_len)

    def collate(self, piece: int, samples: torch.Tensor) -> dict:
        """``{"input_ids": [batch_size, seq_len]}`` int64: ``decode``'s tensor itself."""
        return {"input_ids": samples}

    def __getitem__(self, piece: int) -> dict:
        return self.collate(piece, self.decode(piece, self.read(piece)))

    def stages(self, device=None, quota: int = 2, prefix: str = "data") -> list:
        """``data_stages`` over this file's ``read``, ``decode`` and ``collate``."""
        return data_stages(self.read, self.decode, self.collate, device, quota, prefix)
