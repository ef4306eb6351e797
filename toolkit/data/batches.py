"""One rank's micro-batches of a training step, as data-pipeline actors or as a plain call.

``MicroBatches(source, sampler, accum, n_shards, shard)`` reads, for step
``s`` and micro-batch ``j``, the samples
``micro_batch_rows(sampler.rows(s), accum, j, n_shards, shard)`` of
``source``: this rank's ``S(0)`` shard of micro-batch ``j`` of the step's
global batch (``n_shards``: the shards the recipe's ``data_sbp`` cuts a
batch into, e.g. the dp degree for GPT-2's ``(S(0), B)``).

``source`` is any indexable dataset with the sample-source protocol:
``len(source)`` samples; ``source.read(rows: LongTensor) -> raw`` (the file
I/O); ``source.decode(raw) -> samples`` (a list, or a tensor whose rows are
the samples, already laid out as a batch); ``source.collate(samples) ->
{field: tensor}`` with ``len(samples)`` rows (also for no samples).
``recipes.gpt2.data.TokenSequences`` is one (``{"input_ids": ...}``).

Actor use (``runtime.data_pipeline.data_stages``): piece ``k`` is micro-batch
``k % accum`` of step ``self.step + k // accum``, so a run of ``accum``
pieces per step (set ``step`` before the run starts) and a single long run
from ``step`` both read the right rows. ``read``, ``decode`` and ``collate``
run on the data queue, one actor each; ``stages()`` returns the four actors
(with the host-to-device copy).

Reading ahead (``read_ahead``, see ``toolkit.data.read_ahead``): where the
batches are copied to an accelerator (``stages(device=...)`` with a CUDA
device) and ``read_ahead`` is left ``None``, ``stages()`` returns one
``read`` actor that takes whole batches, loaded and copied to the device
already, from a ``ReadAhead`` of ``read_ahead_threads()`` threads keeping
twice as many micro-batches loading. That actor is on the compute queue: its
action is a lookup, which waits only where loading falls behind the device
(and then holds up the thread's other compute actors, a pipeline rank's
backward passes among them), while on a thread of its own it would add two
cross-thread messages and GIL hand-offs to every batch. A one-device step
then has one thread, whose order the executor records once and replays
(``runtime.executor``). ``read_ahead=n`` reads ``n`` pieces ahead on any
device, ``0`` never: on a CPU host the step itself needs the cores.
Each ``stages()`` call, one data actor, has a read-ahead of its own: a rank
holding a V-shaped pipeline's first and last stage has two data actors
reading the same pieces at different times, and one window shared by both
would drop what the one ahead loaded whenever the other read.

Plain use (evaluation, tests): ``load(step, micro)`` is the same batch.
"""
from __future__ import annotations

import copy
import os
import weakref

import torch

from runtime.data_pipeline import copies_to, data_stages
from runtime.plan import ActorSpec

from .read_ahead import ReadAhead
from .sampler import GlobalBatchSampler, micro_batch_rows


def read_ahead_threads() -> int:
    """Worker threads a rank reads ahead with: its share of the cores it may run on, less one for its step's
    own thread, at most 4 and at least 1.

    A rank bound to cores of its own (``srun --cpu-bind``, ``numactl``,
    torchrun's NUMA binding: cores other than its parent process's) has its
    share already. Otherwise the host's ``LOCAL_WORLD_SIZE`` ranks share the
    cores (all of the host's, or a container's). A rank started through a
    shell that carries its binding (``srun --cpu-bind ... bash -c``) looks
    unbound: its share is divided again, fewer threads than its cores allow.
    """
    if not hasattr(os, "sched_getaffinity"):
        cores, own = os.cpu_count() or 1, False
    else:
        mine = os.sched_getaffinity(0)
        try:
            own = mine != os.sched_getaffinity(os.getppid())
        except OSError:  # the parent is gone or not ours to ask
            own = False
        cores = len(mine)
    ranks = 1 if own else max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(4, cores // ranks - 1))


class MicroBatches:
    """The micro-batches one data shard reads for each step.

    ``step`` (settable) is the step piece 0 belongs to; ``for_step(s)`` is a
    copy bound to step ``s`` (sharing the source and sampler), for runs
    that must not see a later change of ``step``.
    """

    def __init__(self, source, sampler: GlobalBatchSampler, accum: int = 1, n_shards: int = 1, shard: int = 0,
                 step: int = 0, read_ahead: int | None = None):
        if sampler.n_sequences > len(source):
            raise ValueError(f"sampler draws from {sampler.n_sequences} samples but {source!r} holds {len(source)}")
        micro_batch_rows(torch.empty(0, dtype=torch.int64), accum, 0, n_shards, shard)  # validates the sizes
        self.source, self.sampler = source, sampler
        if read_ahead is not None and (isinstance(read_ahead, bool) or not isinstance(read_ahead, int)
                                       or read_ahead < 0):
            raise ValueError(f"read_ahead must be None (on for a CUDA device) or an int >= 0, got {read_ahead!r}")
        self.accum, self.n_shards, self.shard = accum, n_shards, shard
        self.step = step
        self.read_ahead = read_ahead
        self._aheads = weakref.WeakSet()  # the read-aheads ``stages`` made (shared with ``for_step``'s copies)

    @classmethod
    def from_prepared(cls, prepared, split: str, global_batch: int, seed: int = 0, accum: int = 1,
                      n_shards: int = 1, shard: int = 0, step: int = 0) -> "MicroBatches":
        """Over ``prepared.tokens(split)`` with a ``GlobalBatchSampler(len(tokens), global_batch, seed)``."""
        tokens = prepared.tokens(split)
        return cls(tokens, GlobalBatchSampler(len(tokens), global_batch, seed), accum, n_shards, shard, step)

    def for_step(self, step: int) -> "MicroBatches":
        other = copy.copy(self)
        other.step = step
        return other

    def rows(self, piece: int) -> torch.Tensor:
        """The global sample indices piece ``piece`` reads (see the module docstring)."""
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 0:
            raise ValueError(f"piece must be a non-negative int, got {piece!r}")
        step, micro = divmod(piece, self.accum)
        return micro_batch_rows(self.sampler.rows(self.step + step), self.accum, micro, self.n_shards, self.shard)

    def read(self, piece: int):
        """This shard's samples of piece ``piece``, raw (the source's file I/O)."""
        return self.source.read(self.rows(piece))

    def decode(self, piece: int, raw) -> list:
        return self.source.decode(raw)

    def collate(self, piece: int, samples: list) -> dict:
        return self.source.collate(samples)

    def load(self, step: int, micro: int) -> dict:
        """The batch of micro-batch ``micro`` of step ``step`` for this shard, without actors."""
        if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro < self.accum:
            raise ValueError(f"micro must be an int in [0, accum={self.accum}), got {micro!r}")
        batch = self.for_step(step)
        return batch.collate(micro, batch.decode(micro, batch.read(micro)))

    def stages(self, device=None, quota: int = 2, prefix: str = "data") -> list:
        """The data-pipeline actors (consume ``stages[-1].name``): ``data_stages`` over ``read``, ``decode`` and
        ``collate``, or, reading ahead (see the module docstring), one compute actor ``read`` of whole batches
        on ``device``."""
        pieces = self.read_ahead
        if pieces is None:
            pieces = 2 * read_ahead_threads() if copies_to(device) else 0
        if not pieces:
            return data_stages(self.read, self.decode, self.collate, device, quota, prefix)
        ahead = ReadAhead(self, pieces, min(pieces, read_ahead_threads()), device)
        self._aheads.add(ahead)
        return [ActorSpec(f"{prefix}.read", _ReadAhead(self, ahead), queue="compute", quota=quota)]

    def settle(self) -> None:
        """Wait for every batch the read-aheads of ``stages`` are loading (``ReadAhead.settle``)."""
        for ahead in list(self._aheads):
            ahead.settle()

    def close(self) -> None:
        """Stop the read-aheads of ``stages`` (``ReadAhead.close``): a job that is done loads nothing more."""
        for ahead in list(self._aheads):
            ahead.close()

    def __copy__(self) -> "MicroBatches":  # ``for_step``'s copies share the read-aheads (pickling drops them)
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_aheads": None}  # a copy in another process has no read-ahead of this one's

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _aheads=weakref.WeakSet())

    def __repr__(self) -> str:
        return (f"MicroBatches({self.source!r}, {self.sampler!r}, accum={self.accum}, "
                f"n_shards={self.n_shards}, shard={self.shard}, step={self.step})")


class _ReadAhead:
    """A read actor's action: piece ``k`` of the run that ``batches.step`` starts, from its ``ahead``."""

    def __init__(self, batches: MicroBatches, ahead: ReadAhead):
        self.batches, self.ahead = batches, ahead

    def __call__(self, piece: int):
        return self.ahead.get(self.batches.step * self.batches.accum + piece)
