"""The one choke point where sbp_core talks to ``torch.distributed`` (with ``collective_plans.py``, its planned forms).

Every function takes the participating global ranks *in mesh-axis order*
(``ranks[k]`` holds piece ``k``) and hides that process groups order their
members by global rank. Each call records what this rank sends in the
communication ledger (see ``ledger.py`` for the byte convention):

- all-gather: ``(p-1)`` copies of the local piece;
- reduce-scatter: every piece but its own;
- all-reduce (ring): reduce-scatter plus all-gather of its own piece (also
  ``all_reduce_packed_start``, which runs exactly those two);
- ``*_start``: the same collectives started asynchronously, returning a ``Pending``;
- reduce: every rank but the root sends its tensor once;
- all-to-all: every piece but its own;
- point-to-point: the bytes of each send.

Any dtype crosses: ``wire.py`` says how (bytes for transfers, a wider
integer dtype for reductions of int16, uint16 and uint32).

Uneven pieces (``torch.tensor_split`` sizes) use ``all_to_all_single`` with
split sizes, so no padding is ever sent.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import pickle
import threading

import torch
import torch.distributed as dist

from .. import ledger
from ..layout import reduce_rows, reduce_terms, shard_sizes
from ..process_groups import control_group, get_timeout, group_of, tensor_device, world_rank
from ..torch_compat import all_gather_flat as _all_gather_flat, reduce_scatter_flat as _reduce_scatter_flat
from .wire import dumps, moved, reduced, summable


class CollectiveError(RuntimeError):
    """A collective or transfer failed or timed out; names the op, the peers and the rank."""


def _failure(name: str, peers, exc: RuntimeError, bound: float) -> CollectiveError:
    """``bound``: the timeout the wait started under (``get_timeout()`` when it started)."""
    return CollectiveError(f"{name} with ranks {sorted(peers)} failed on rank {world_rank()} "
                           f"(timeout {bound:g} s for sbp_core's groups): {exc}")


def _collective(peers_of):
    """Re-raise backend failures (gloo/NCCL timeouts, lost peers) as a ``CollectiveError``."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = get_timeout()
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                if isinstance(exc, CollectiveError):
                    raise
                raise _failure(fn.__name__, peers_of(*args, **kwargs), exc, bound) from exc

        return call

    return wrap


_by_ranks = _collective(lambda _t, ranks, *a, **k: ranks)

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sums_terms(group) -> bool:
    """Whether a reduce-scatter on ``group`` runs as an all-to-all plus a local reduction of the
    ``p`` received terms in axis order (``reduce_rows``), not as the backend's reduce-scatter.

    On gloo: its reduce-scatter takes about twice the wall and CPU time of an
    all-to-all of the same buffer plus the local sum (4 ranks, 64 KiB-3.3 MiB:
    11-28 ms vs 4-15 ms wall, 1.3-3.2 vs 0.4-1.6 ms CPU); each rank sends the
    same ``(p-1)`` pieces either way. Every reduce-scatter (planned, general,
    coalesced) decides alike, so they all sum an element's terms in one order.
    """
    return dist.get_backend(group) == "gloo"


def _group_order(ranks):
    """Axis positions in group-rank order (groups sort their members)."""
    return sorted(range(len(ranks)), key=lambda k: ranks[k])


def _all_to_all_flat(send_pieces, recv_numels, ranks, dtype, device):
    """Send ``send_pieces[k]`` (flat) to ``ranks[k]``; return the flat pieces received, in axis order."""
    order = _group_order(ranks)
    inp = torch.cat([send_pieces[k].reshape(-1) for k in order]) if send_pieces else None
    out = torch.empty(sum(recv_numels), dtype=dtype, device=device)
    dist.all_to_all_single(
        moved(out),
        moved(inp) if inp is not None else None,
        output_split_sizes=[recv_numels[k] for k in order],
        input_split_sizes=[send_pieces[k].numel() for k in order],
        group=group_of(ranks),
    )
    got = dict(zip(order, out.split([recv_numels[k] for k in order])))
    return [got[k] for k in range(len(ranks))]


@_by_ranks
def all_gather(local: torch.Tensor, ranks, dim: int, length: int) -> torch.Tensor:
    """Concatenate the pieces along ``dim``; ``length`` is the gathered size of ``dim``."""
    p = len(ranks)
    me = ranks.index(world_rank())
    sizes = shard_sizes(length, p)
    ledger.record("all_gather", p, (p - 1) * _nbytes(local), ranks)
    if p == 1:
        return local
    local = local.contiguous()
    if len(set(sizes)) == 1:
        buf = torch.empty((p,) + tuple(local.shape), dtype=local.dtype, device=local.device)
        _all_gather_flat(moved(buf.view(-1)), moved(local.view(-1)), group=group_of(ranks))
        order = _group_order(ranks)
        if order == list(range(p)):
            # buf[k] is piece k: along dim 0 the buffer already is the result (a view).
            return buf.movedim(0, dim).flatten(dim, dim + 1)
        pieces = [None] * p
        for g, k in enumerate(order):
            pieces[k] = buf[g]
    else:
        shapes = []
        for n in sizes:
            s = list(local.shape)
            s[dim] = n
            shapes.append(s)
        numels = [int(torch.Size(s).numel()) for s in shapes]
        flat = _all_to_all_flat([local] * p, numels, ranks, local.dtype, local.device)
        pieces = [f.view(s) for f, s in zip(flat, shapes)]
        pieces[me] = local
    return torch.cat(pieces, dim)


@_by_ranks
def reduce_scatter(full: torch.Tensor, ranks, dim: int, op: str) -> torch.Tensor:
    """Reduce the ranks' ``full`` tensors with ``op``; rank ``k`` keeps piece ``k`` along ``dim``."""
    if summable(full.dtype, op) != full.dtype:
        return reduce_scatter(full.to(summable(full.dtype, op)), ranks, dim, op).to(full.dtype)
    p = len(ranks)
    me = ranks.index(world_rank())
    pieces = list(torch.tensor_split(full, p, dim))
    ledger.record("reduce_scatter", p, _nbytes(full) - _nbytes(pieces[me]), ranks)
    if p == 1:
        return full.clone()
    if len({t.shape for t in pieces}) == 1 and not sums_terms(group_of(ranks)):
        order = _group_order(ranks)
        if dim == 0 and order == list(range(p)):
            inp = full.contiguous()
        else:
            inp = torch.stack([pieces[k] for k in order])
        out = torch.empty(pieces[me].shape, dtype=full.dtype, device=full.device)
        _reduce_scatter_flat(reduced(out.view(-1)), reduced(inp.reshape(-1)), op=_REDUCE[op], group=group_of(ranks))
        return out
    mine = pieces[me]
    flat = _all_to_all_flat([t.contiguous() for t in pieces], [mine.numel()] * p, ranks, full.dtype, full.device)
    received = [f.view(mine.shape) for f in flat]
    received[me] = mine
    return reduce_terms(received, op)


@_by_ranks
def all_reduce(t: torch.Tensor, ranks, op: str) -> torch.Tensor:
    """Element-wise reduction of the ranks' tensors, returned as a new tensor on every rank."""
    if summable(t.dtype, op) != t.dtype:
        return all_reduce(t.to(summable(t.dtype, op)), ranks, op).to(t.dtype)
    p = len(ranks)
    me = ranks.index(world_rank())
    own = shard_sizes(t.numel(), p)[me] * t.element_size()
    ledger.record("all_reduce", p, _nbytes(t) + (p - 2) * own if p > 1 else 0, ranks)
    out = t.clone(memory_format=torch.contiguous_format)
    if p > 1:
        dist.all_reduce(reduced(out), op=_REDUCE[op], group=group_of(ranks))
    return out


def _wait(work, group) -> None:
    """Wait for ``work`` on ``group``: on gloo for at most the groups' current timeout (``get_timeout``).

    A gloo send or receive is bounded by the timeout its group was built
    with, which ``process_groups.set_timeout`` and ``initialising`` cannot
    change, so the wait passes the current one. A gloo collective and NCCL
    read the group's (``_set_pg_timeout``) when they start; an NCCL wait
    with a timeout would block the host, where it should only order the
    current stream.
    """
    if dist.get_backend(group) == "gloo":
        work.wait(datetime.timedelta(seconds=get_timeout()))
    else:
        work.wait()


def _send(t: torch.Tensor, dst: int, group) -> None:
    """``dist.send``, waited by ``_wait``."""
    _wait(dist.isend(t, dst, group=group), group)


def _recv(t: torch.Tensor, src: int, group) -> None:
    """``dist.recv`` from ``src``, waited by ``_wait``."""
    _wait(dist.irecv(t, src, group=group), group)


class Pending:
    """A collective in flight (``async_op``): ``wait()`` blocks until it is done and returns its result.

    ``then`` (optional) starts a follow-up collective from the first one's
    result and returns its ``Pending``: ``advance()`` waits for the first and
    starts the follow-up early (so it too overlaps whatever runs next);
    ``wait()`` does what is left. Every rank must start, advance and wait its
    collectives in the same order. ``ordered``: the follow-up runs after the
    first by itself (NCCL: one communicator's collectives run in order on its
    stream) and ``finish`` only hands over the first's output, so ``advance``
    starts it without waiting; under NCCL a wait makes the current stream
    (backward's, in a gradient bucket's hook) wait for the first collective.
    ``wait()`` waits for both.
    """

    def __init__(self, work, finish, ranks, then=None, ordered: bool = False):
        self._work, self._finish, self._ranks, self._then = work, finish, ranks, then
        self._next = None
        self._ordered = ordered
        self._bound = get_timeout()  # the bound the collective started under, for its error

    def _wait_first(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()  # a collective's own bound (the group's timeout), or _AllOf's
            except RuntimeError as exc:
                raise _failure("collective", self._ranks, exc, self._bound) from exc
            self._work = None

    def _done_first(self):
        self._wait_first()
        return self._finish()

    def advance(self) -> None:
        """Wait for the first collective (unless ``ordered``) and start the follow-up, if any and not yet
        started.

        Always waits rather than only when the first is already done: whether it is
        differs between ranks, and collectives must start in one order on all of them."""
        if self._then is not None and self._next is None:
            self._next = self._then(self._finish() if self._ordered else self._done_first())

    def wait(self):
        if self._then is None:
            return self._done_first()
        self.advance()
        out = self._next.wait()
        self._wait_first()  # where ordered, not waited yet (done: the follow-up ran after it)
        return out


def _done(value, ranks) -> Pending:
    return Pending(None, lambda: value, ranks)


def _narrowed(pending: Pending, dtype: torch.dtype) -> Pending:
    """``pending``'s result cast back to ``dtype``: a reduction run in a wider dtype (``wire.summable``)."""
    return Pending(None, lambda: pending.wait().to(dtype), pending._ranks)


@_by_ranks
def reduce_scatter_start(chunks: torch.Tensor, ranks, op: str, record: bool = True) -> Pending:
    """Start a reduce-scatter of a flat buffer of ``p`` equal chunks (chunk ``k`` for ``ranks[k]``);
    ``wait()`` gives this rank's reduced chunk. Records what ``reduce_scatter`` records."""
    if summable(chunks.dtype, op) != chunks.dtype:
        return _narrowed(reduce_scatter_start(chunks.to(summable(chunks.dtype, op)), ranks, op, record), chunks.dtype)
    p = len(ranks)
    width = chunks.numel() // p
    if record:
        ledger.record("reduce_scatter", p, (p - 1) * width * chunks.element_size(), ranks)
    if p == 1:
        return _done(chunks.clone(), ranks)
    order = _group_order(ranks)
    view = chunks.view(p, width)
    inp = view.reshape(-1) if order == list(range(p)) else view[order].reshape(-1)
    group = group_of(ranks)
    held = [inp]  # the input stays alive until the collective is done
    if sums_terms(group):
        got = torch.empty_like(inp)
        work = dist.all_to_all_single(moved(got), moved(inp), group=group, async_op=True)

        def finish_terms():
            held.clear()
            rows = got.view(p, width)  # row g from group rank g: back to axis order
            return reduce_rows(rows if order == list(range(p)) else rows[[order.index(k) for k in range(p)]], op)

        return Pending(work, finish_terms, ranks)
    out = torch.empty(width, dtype=chunks.dtype, device=chunks.device)
    work = _reduce_scatter_flat(reduced(out), reduced(inp), op=_REDUCE[op], group=group, async_op=True)

    def finish():
        held.clear()  # the backend keeps its own hold on ``inp`` until its work is waited
        return out

    # NCCL: a collective started after this one on its group runs after it (``Pending``'s ``ordered``).
    return Pending(work, finish, ranks, ordered=dist.get_backend(group) == "nccl")


@_by_ranks
def all_gather_start(mine: torch.Tensor, ranks, record: bool = True) -> Pending:
    """Start an all-gather of equal flat pieces; ``wait()`` gives a ``(p, width)`` buffer, row ``k`` from ``ranks[k]``."""
    p = len(ranks)
    if record:
        ledger.record("all_gather", p, (p - 1) * _nbytes(mine), ranks)
    if p == 1:
        return _done(mine.view(1, -1), ranks)
    out = torch.empty(p, mine.numel(), dtype=mine.dtype, device=mine.device)
    work = _all_gather_flat(moved(out.view(-1)), moved(mine.contiguous()), group=group_of(ranks), async_op=True)
    order = _group_order(ranks)

    def finish():
        return out if order == list(range(p)) else out[[order.index(k) for k in range(p)]]

    return Pending(work, finish, ranks)


@_by_ranks
def all_reduce_packed_start(packed: torch.Tensor, ranks, op: str, counts, owned: bool = False) -> Pending:
    """Start an all-reduce of a buffer packed as ``p`` equal chunks (chunk ``k``: every tensor's piece ``k``),
    as a reduce-scatter then an all-gather; ``wait()`` gives the reduced ``(p, width)`` buffer.

    Why not one ``all_reduce`` of the buffer: the ring algorithm's per-element
    summation order depends on where the element sits in the buffer, so
    concatenating tensors changes their rounding (on 4 ranks ~1e-7 relative,
    which AdamW amplifies to 1e-3 where a gradient is near ``eps``). Packing
    piece ``k`` of each tensor into chunk ``k`` gives every element the order
    ``reduce_scatter_start`` gives it wherever it sits (ZeRO's coalesced
    reduce-scatter: the same order). ``counts[k]``
    is chunk ``k``'s unpadded length; the ledger records one all-reduce of
    ``sum(counts)`` elements, the same bytes as the ring (and the per-tensor calls).
    The all-gather starts on ``advance()`` (or ``wait()``), after the reduce-scatter is done.
    On two ranks the order question does not arise: one ``all_reduce`` of the buffer (in place when the
    caller hands it over, ``owned``).
    """
    if summable(packed.dtype, op) != packed.dtype:
        wide = all_reduce_packed_start(packed.to(summable(packed.dtype, op)), ranks, op, counts, owned=True)
        return _narrowed(wide, packed.dtype)
    p = len(ranks)
    me = ranks.index(world_rank())
    es = packed.element_size()
    ledger.record("all_reduce", p, (sum(counts) + (p - 2) * counts[me]) * es if p > 1 else 0, ranks)
    if p == 1:
        return _done(packed.view(1, -1).clone(), ranks)
    if p == 2:
        # Every element is a + b whatever the algorithm (IEEE addition commutes), so one all-reduce
        # is exact here, and on gloo 1.7x faster than the two halves (1 and 8 MiB, 2 ranks).
        out = packed if owned else packed.clone()
        work = dist.all_reduce(reduced(out), op=_REDUCE[op], group=group_of(ranks), async_op=True)
        return Pending(work, lambda: out.view(p, -1), ranks)
    first = reduce_scatter_start(packed, ranks, op, record=False)
    return Pending(first._work, first._finish, ranks,
                   then=lambda mine: all_gather_start(mine, ranks, record=False), ordered=first._ordered)


@_by_ranks
def reduce(t: torch.Tensor, ranks, op: str) -> torch.Tensor:
    """Reduce the ranks' tensors with ``op`` onto ``ranks[0]`` (tree: every other rank sends once).

    Returns the reduced tensor on ``ranks[0]``; elsewhere a buffer of no meaning.
    """
    if summable(t.dtype, op) != t.dtype:
        return reduce(t.to(summable(t.dtype, op)), ranks, op).to(t.dtype)
    p = len(ranks)
    me = ranks.index(world_rank())
    ledger.record("reduce", p, 0 if me == 0 else _nbytes(t), ranks)
    out = t.clone(memory_format=torch.contiguous_format)
    if p > 1:
        dist.reduce(reduced(out), dst=ranks[0], op=_REDUCE[op], group=group_of(ranks))
    return out


@_by_ranks
def all_to_all(local: torch.Tensor, ranks, split_dim: int, cat_dim: int, cat_length: int) -> torch.Tensor:
    """S(cat_dim) -> S(split_dim): cut ``local`` along ``split_dim``, send piece ``k`` to rank ``k``,
    concatenate what arrives along ``cat_dim`` (whose gathered size is ``cat_length``).

    One copy into the send buffer (none when the pieces already lie in order
    in memory) and none out of the receive buffer along dim 0.
    """
    p = len(ranks)
    me = ranks.index(world_rank())
    send = torch.tensor_split(local, p, split_dim)
    ledger.record("all_to_all", p, _nbytes(local) - _nbytes(send[me]), ranks)
    if p == 1:
        return local
    order = _group_order(ranks)
    in_order = order == list(range(p))
    if split_dim == 0 and in_order and local.is_contiguous():
        inp = local.reshape(-1)
    else:
        inp = torch.empty(local.numel(), dtype=local.dtype, device=local.device)
        off = 0
        for k in order:
            n = send[k].numel()
            inp[off : off + n].view(send[k].shape).copy_(send[k])
            off += n
    shapes = []
    for n in shard_sizes(cat_length, p):
        s = list(send[me].shape)
        s[cat_dim] = n
        shapes.append(s)
    recv = [int(torch.Size(s).numel()) for s in shapes]
    out = torch.empty(sum(recv), dtype=local.dtype, device=local.device)
    dist.all_to_all_single(
        moved(out), moved(inp),
        output_split_sizes=[recv[k] for k in order],
        input_split_sizes=[send[k].numel() for k in order],
        group=group_of(ranks),
    )
    if cat_dim == 0 and in_order:
        whole = list(send[me].shape)
        whole[0] = cat_length
        return out.view(whole)  # the pieces arrived concatenated along dim 0
    got = dict(zip(order, out.split([recv[k] for k in order])))
    return torch.cat([got[k].view(shapes[k]) for k in range(p)], cat_dim)


def exchange(sends, recvs) -> list:
    """Point-to-point transfers on the world group (global ranks).

    ``sends``: ``[(dst_rank, tensor)]``; ``recvs``: ``[(src_rank, shape, dtype, device)]``.
    Returns the received tensors in ``recvs`` order. Between one pair of ranks
    messages match in the order they are posted, so both sides must list them alike.
    """
    return exchange_start(sends, recvs).wait()


class _AllOf:
    """Several works waited as one."""

    def __init__(self, works, group):
        self.works, self.group = works, group

    def wait(self) -> None:
        for w in self.works:
            _wait(w, self.group)


@_collective(lambda sends, recvs: {r for r, *_ in sends} | {r for r, *_ in recvs})
def exchange_start(sends, recvs) -> Pending:
    """``exchange`` with every transfer posted and none waited: ``wait()`` gives the received tensors.

    The sent tensors must not change until ``wait()`` returns (a
    non-contiguous one is sent from a contiguous copy). Exchanges between one
    pair of ranks match in the order they are started, whatever runs between.
    """
    out = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype, device in recvs]
    ops = [dist.P2POp(dist.irecv, moved(buf), src) for (src, *_), buf in zip(recvs, out)]
    payload = [t.contiguous() for _, t in sends]  # kept alive until the wait returns
    for (dst, _), t in zip(sends, payload):
        ledger.record("send", 2, _nbytes(t), (world_rank(), dst))
        ops.append(dist.P2POp(dist.isend, moved(t), dst))
    # One batch: NCCL runs a pair's transfers in the order they are posted, so two ranks that each
    # post a receive before their send to the other would wait on each other; a batch is one group.
    works = dist.batch_isend_irecv(ops) if ops else []

    def received() -> list:
        payload.clear()  # every send is done: its buffer may go
        return out

    return Pending(_AllOf(works, dist.group.WORLD), received, {r for r, *_ in sends} | {r for r, *_ in recvs} | {world_rank()})


@_by_ranks
def all_gather_object(obj, ranks) -> list:
    """Gather one small picklable object per rank (layout checks); records no tensor bytes.

    Goes over the ranks' control group (gloo), so no device round trip under NCCL."""
    p = len(ranks)
    if p == 1:
        return [obj]
    out = [None] * p
    dist.all_gather_object(out, obj, group=control_group(group_of(ranks)))
    order = _group_order(ranks)
    res = [None] * p
    for g, k in enumerate(order):
        res[k] = out[g]
    ledger.record("all_gather_object", p, 0, ranks)
    return res


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
           torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]
_HEADER = 16  # kind, dtype code, ndim, shape...


@_collective(lambda values, src, group: {src})
def broadcast_ints(values, src: int, group) -> list:
    """``src``'s list of ints, on every rank of ``group`` (the others pass a list of the same length).

    A host message: sent over ``group``'s control group (gloo), never through a device."""
    t = torch.tensor(values, dtype=torch.int64)
    if world_rank() == src:
        ledger.record("broadcast", 2, _nbytes(t), (src,))
    dist.broadcast(t, src=src, group=control_group(group))
    return t.tolist()


_P2P = threading.local()


def ready_mark(device: torch.device):
    """What a send from another thread waits for in place of everything queued so far (``send_tensor``'s
    and ``send_object``'s ``ready``): on CUDA an event recorded on this thread's current stream, right
    after the work that produced the value; anything not CUDA: ``None`` (nothing to wait for)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _on_transfer_device(t: torch.Tensor, group, ready):
    """``(t as group's backend sends it, what its transfer waits for)``: ``t`` detached, on
    ``tensor_device(group)`` and contiguous, and ``ready`` unless that took a copy, which this thread's
    current stream queued (then ``None``: the transfer waits for that stream)."""
    u = t.detach().to(tensor_device(group)).contiguous()
    copied = u.data_ptr() != t.data_ptr() or u.device != t.device
    return u, None if copied else ready


def block_until_done(stream) -> None:
    """Block this thread until what ``stream`` has queued is done, yielding its core while it waits.

    ``stream.synchronize()`` spins a core where a process has one CUDA
    context (CUDA's default scheduling), one per waiting thread: a rank's
    transfer and read-ahead threads would take cores its compute thread and
    NCCL's proxy threads need. A blocking event sleeps instead.
    """
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


def _own_stream(device: torch.device):
    """This thread's own stream on ``device``, for its transfers (``_settled``) or kernels (``after_marks``)."""
    streams = _P2P.__dict__.setdefault("streams", {})
    if device not in streams:
        # High priority: torch hands streams out round-robin from a pool of 32 per priority, and NCCL's
        # communicators take theirs from the normal pool. Two threads' transfers on one stream would
        # queue a send behind a receive posted ahead; from their own pool these streams are distinct
        # up to 32 threads (a dp2_tp2_pp2 rank with two stages per pipeline rank runs 7 transfer threads).
        streams[device] = torch.cuda.Stream(device, priority=-1)
    return streams[device]


@contextlib.contextmanager
def after_marks(device: torch.device, marks):
    """Queue the block's kernels on this thread's own stream, behind the ``ready_mark``s ``marks`` alone
    (``None`` among them: behind everything this thread's current stream has queued so far).

    For an actor off the compute thread that works on the compute thread's
    values (a pipeline boundary's cut on the copy thread): on the device's
    default stream, which every thread shares, its kernels and a
    ``ready_mark`` taken after them would also wait for whatever compute the
    compute thread queued since its value, such as a step-end all-reduce
    that waits for the other stage, which waits for this very send. Inside
    the block a ``ready_mark`` covers the block's kernels and the marked
    values' alone. A tensor the block reads and a kernel of the block uses
    must be ``record_stream``-ed on the current stream by the block (its
    memory belongs to the stream that made it). Anything not CUDA: nothing
    to do.
    """
    if device.type != "cuda":
        yield
        return
    stream = _own_stream(device)
    for mark in marks:
        if mark is None:
            stream.wait_stream(torch.cuda.current_stream(device))
        else:
            stream.wait_event(mark)
    with torch.cuda.stream(stream):
        yield


@contextlib.contextmanager
def _settled(device: torch.device, after_current: bool = True, ready=None):
    """Run the block's transfers on a stream of this thread's own, and return once they are done.

    Under NCCL a transfer's ``wait`` only makes the current stream wait for
    it. The runtime's receive actors post receives ahead of their data (two
    registers a channel), from threads whose current stream is the device's
    default one; every kernel queued there later, the work that produces the
    data included, would wait behind such a receive: a deadlock. On a stream
    of its own a transfer holds up nothing else, and the calling thread
    blocks until it is done, as under gloo. ``after_current``: the stream
    first waits for what the thread's current stream has queued (a send's
    producer). A receive passes ``False``: its buffer is allocated inside the
    block, on the transfer's stream, so the receive need not wait for the
    device to drain the compute queued so far (``_received`` then hands the
    buffer to the current stream). ``ready`` (a ``ready_mark`` of the producer's thread): the stream
    waits for that event in place of the current stream, so a send leaves as soon as its producer's
    kernels are done, not behind the compute its thread queued after them. Anything not CUDA: nothing
    to do.
    """
    if device.type != "cuda":
        yield
        return
    stream = _own_stream(device)
    if ready is not None:
        stream.wait_event(ready)
    elif after_current:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    block_until_done(stream)


def _received(buf: torch.Tensor) -> torch.Tensor:
    """``buf``, filled by a transfer ``_settled`` has waited for, handed to the current stream: the caching
    allocator must not give its memory to the next transfer before the kernels queued there read it."""
    if buf.is_cuda:
        buf.record_stream(torch.cuda.current_stream(buf.device))
    return buf


@_collective(lambda obj, dst, group, ready=None: {dst})
def send_object(obj, dst: int, group, ready=None) -> None:
    """Send a tensor (header, then its data) or any picklable object to ``dst`` on ``group``.

    Blocking (on a GPU too: ``_settled``); for the runtime's channels, each on a group and thread of its
    own. The header and a pickled object travel on the host over ``group``'s
    control group (gloo); a tensor's data travels on ``group`` from the device
    its backend needs (``tensor_device``: this rank's GPU under NCCL), copied
    there first when it lies elsewhere. ``ready``: ``ready_mark`` of the
    thread that produced ``obj`` (``None``: wait for this thread's current
    stream); not used when the data had to be copied first.
    """
    header = torch.zeros(_HEADER, dtype=torch.int64)
    control = control_group(group)
    if isinstance(obj, torch.Tensor) and obj.dtype in _DTYPES and obj.dim() <= _HEADER - 3:
        (payload, ready), on = _on_transfer_device(obj, group, ready), group
        header[0], header[1], header[2] = 0, _DTYPES.index(obj.dtype), obj.dim()
        header[3 : 3 + obj.dim()] = torch.tensor(obj.shape, dtype=torch.int64)
    else:
        data = dumps(obj)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        on = control
        header[0], header[1], header[2], header[3] = 1, _DTYPES.index(torch.uint8), 1, len(data)
    ledger.record("send", 2, _nbytes(payload), (world_rank(), dst))
    _send(header, dst, control)
    if payload.numel():
        with _settled(payload.device, ready=ready):
            _send(moved(payload), dst, on)


@_collective(lambda src, group, device=None: {src})
def recv_object(src: int, group, device=None):
    """Receive what ``send_object`` sent from ``src`` on ``group``: a tensor on ``device``
    (``None``: where ``group``'s backend delivers it), or the unpickled object."""
    control = control_group(group)
    header = torch.empty(_HEADER, dtype=torch.int64)
    _recv(header, src, control)
    kind, code, ndim = header[:3].tolist()
    shape = header[3 : 3 + ndim].tolist()
    if kind == 1:
        buf = torch.empty(shape, dtype=torch.uint8)
        if buf.numel():
            _recv(buf, src, control)
        return pickle.loads(buf.numpy().tobytes())
    on = tensor_device(group)
    with _settled(on, after_current=False):
        buf = torch.empty(shape, dtype=_DTYPES[code], device=on)
        if buf.numel():
            _recv(moved(buf), src, group)
    buf = _received(buf)
    return buf if device is None else buf.to(device)


@_collective(lambda t, dst, group, ready=None: {dst})
def send_tensor(t: torch.Tensor, dst: int, group, ready=None) -> None:
    """Send a contiguous tensor's data alone to ``dst`` on ``group``; blocking.

    For a channel whose every value has one shape and dtype that both ends
    know (``recv_tensor``): one transfer per value, where ``send_object``
    sends a header first and the receiver waits for it before it can post
    the data's receive. Sent from ``tensor_device(group)`` (copied there first
    when ``t`` lies elsewhere). ``ready``: as ``send_object``'s. Under NCCL a
    one-byte token goes first, over the control group (``recv_tensor``).
    """
    ledger.record("send", 2, _nbytes(t), (world_rank(), dst))
    t, ready = _on_transfer_device(t, group, ready)
    control = control_group(group)
    if control is not group:
        _send(torch.zeros(1, dtype=torch.uint8), dst, control)
    with _settled(t.device, ready=ready):
        _send(moved(t), dst, group)


@_collective(lambda peer, group, send: {peer})
def open_p2p(peer: int, group, send: bool) -> None:
    """One element to (``send``) or from ``peer`` on ``group``, recorded in no ledger; blocking.

    Under NCCL a group's communicator is built by its first operation
    (``ncclCommInitRank``, which allocates device memory): this lets the
    caller choose when, and in which order, each of a rank's channels is
    built, rather than on the channel's own thread in the middle of a run.
    """
    on = tensor_device(group)
    with _settled(on, after_current=False):
        one = torch.zeros(1, device=on)
        if send:
            _send(one, peer, group)
        else:
            _recv(one, peer, group)


@_collective(lambda shape, dtype, src, group, device=None: {src})
def recv_tensor(shape, dtype, src: int, group, device=None) -> torch.Tensor:
    """Receive what ``send_tensor`` sent from ``src`` on ``group``, into a new tensor of ``shape`` and
    ``dtype`` on ``device`` (``None``: where ``group``'s backend delivers it).

    Under NCCL the receive is posted only once the sender's token has come over the control group
    (gloo): this thread waits for it on the host. A receive posted ahead of its data would be a kernel
    waiting on the device, and a device-wide synchronisation (inductor's autotuning on a compiled
    stage's first run, ``cudaFree`` when the allocator frees its cache) would wait for it, and with
    it for data that the synchronising rank's own blocked work is to produce: a deadlock."""
    control = control_group(group)
    if control is not group:
        _recv(torch.empty(1, dtype=torch.uint8), src, control)
    on = tensor_device(group)
    with _settled(on, after_current=False):
        buf = torch.empty(shape, dtype=dtype, device=on)
        _recv(moved(buf), src, group)
    buf = _received(buf)
    return buf if device is None else buf.to(device)
