"""Rehearsal: one rank's share of a step on fake tensors in a fake world — what our dispatcher really does.

The simulator needs, per pipeline stage and layout, the local aten calls a
rank runs (with their local shapes), the collectives it joins (ranks and
bytes) and the memory it holds. Rather than re-deriving SBP decisions, we
*run* the stage: inside ``Rehearsal(world_size)`` the default process group
is torch's fake backend (this process is rank 0 of ``world_size``; every
collective returns at once and sends nothing) and every tensor is a
``FakeTensor`` (shape, dtype and strides, no storage). Global tensors
dispatch as in training — signature choice, boxing, decompositions — so the
trace is the real program's, and every collective reaches the communication
ledger at its one choke point (``boxing.collectives``).

A subclass of ``FakeTensorMode`` sees every aten call. A call with global
tensor arguments is one of the program's ops (``GlobalOp``; its signature
decision comes from ``sc.explain``); a call on plain tensors is this rank's
local work (``OpCall``, with hashable argument specs that a cost model can
price by measuring or by a roofline). Storages created during a phase are
tracked by weak reference, giving the phase's peak and end-of-phase live
bytes (the activation stash a forward leaves for its backward).

Why the fake process group from ``torch.testing._internal``: it is the one
torch ships for running a distributed program as one rank of a pretend
world (importing it registers the ``fake`` backend); ``torch.distributed``
itself exports none.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

from sbp_core import ledger as _ledger
from sbp_core.dispatch import decisions, explain
from sbp_core.global_tensor import GlobalTensor
from sbp_core.process_groups import forget_groups


class TensorSpec(NamedTuple):
    """A local tensor argument as a cost model sees it."""

    shape: tuple
    stride: tuple
    dtype: str  # e.g. "float32"


class OpCall(NamedTuple):
    """One local aten call on this rank. ``key`` (op and argument specs) is what a cost model prices."""

    op: str  # e.g. "aten.mm.default"
    args: tuple  # (positional argument specs, ((keyword, spec), ...)); see ``spec_of``
    module: str  # the forward module it ran in ("" in backward and outside modules)

    @property
    def key(self) -> tuple:
        return self.op, self.args


class Collective(NamedTuple):
    """One collective or transfer this rank joined: the ledger's record (``bytes``: what this rank sends)."""

    op: str
    ranks: tuple
    bytes: int


class GlobalOp(NamedTuple):
    """One op of the program's logical graph (global shapes, in program order) and the signature the dispatcher chose.

    ``required`` is ``"decomposed"`` when the op ran as other ops (listed after it).
    """

    op: str
    module: str
    shapes: tuple  # global shape of each global input
    inputs: tuple  # N-d SBP of each global input as it arrived
    required: object  # N-d SBP each input was boxed to, or "decomposed"
    outputs: tuple  # N-d SBP of each output
    boxing_bytes: float


@dataclass
class PhaseTrace:
    """What one phase (a forward, a backward, the gradient reduction, the update) did on this rank."""

    name: str
    events: list = field(default_factory=list)  # OpCall | Collective, in program order
    global_ops: list = field(default_factory=list)  # GlobalOp, in dispatch order
    peak_bytes: int = 0  # most bytes of storages created in the phase alive at once
    end_bytes: int = 0  # bytes of those storages still alive when it ended

    @property
    def calls(self) -> list:
        return [e for e in self.events if isinstance(e, OpCall)]

    @property
    def collectives(self) -> list:
        return [e for e in self.events if isinstance(e, Collective)]


def spec_of(x):
    """A hashable, rebuildable description of an aten argument (tensors by shape, stride and dtype)."""
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."))
    if isinstance(x, (list, tuple)):
        return tuple(spec_of(v) for v in x)
    if isinstance(x, torch.dtype):
        return ("dtype", str(x).removeprefix("torch."))
    if isinstance(x, torch.device):
        return ("device", x.type)
    if isinstance(x, (torch.memory_format, torch.layout)):
        return (type(x).__name__, str(x).removeprefix("torch."))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ("opaque", type(x).__name__)


def _op_name(func) -> str:
    return f"{func.namespace}.{func._opname}.{func._overloadname}"


class _Recorder(FakeTensorMode):
    """``FakeTensorMode`` that reports every call to its rehearsal (if any).

    Reading a value out of a fake tensor that has none (not made from a
    constant) gives 0 (``False``): a rehearsal only needs shapes, and
    data-dependent control flow takes the zero branch.
    """

    def __init__(self, rehearsal):
        super().__init__(allow_non_fake_inputs=True)
        self.rehearsal = rehearsal
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            try:  # a fake tensor made from a constant (e.g. the optimizer's step count) still knows it
                return super().__torch_dispatch__(func, types, args, kwargs)
            except DataDependentOutputException:  # ``int(torch.randint(...))`` for a seed: no value; say 0
                return False if args[0].dtype == torch.bool else 0
        r = self.rehearsal
        if r is None or r.current is None or self._depth:  # outside phases, or the mode's own decompositions
            return super().__torch_dispatch__(func, types, args, kwargs)
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, GlobalTensor) for a in leaves):
            r.global_calls.append((_op_name(func), r.module(),
                                   tuple(tuple(a.shape) for a in leaves if isinstance(a, GlobalTensor))))
            return super().__torch_dispatch__(func, types, args, kwargs)
        if any(getattr(a, "type", None) == "meta" or getattr(getattr(a, "device", None), "type", None) == "meta"
               for a in leaves if isinstance(a, (torch.Tensor, torch.device))):
            # The dispatcher's shape inference (``dispatch._decide`` runs the op on meta tensors): no work.
            return super().__torch_dispatch__(func, types, args, kwargs)
        events = r.current.events
        if func.namespace == "aten":
            r.flush_ledger()
            events.append(OpCall(_op_name(func), (spec_of(tuple(args)), tuple(
                (k, spec_of(v)) for k, v in kwargs.items())), r.module()))
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except Exception:
            # A call that raised did no work (e.g. a view the shard's strides refuse, which the caller
            # then makes from a copy): it is not a kernel to price.
            if func.namespace == "aten":
                events.pop()
            raise
        finally:
            self._depth -= 1
        for t in tree_leaves(out):
            if isinstance(t, FakeTensor):
                r.track(t)
        return out


# Decisions made in fake worlds, where this process is always rank 0: valid across rehearsals, never
# for a real world (which ``dispatch`` keeps in its own cache).
_FAKE_DECISIONS: dict = {}


def fake_tensors() -> FakeTensorMode:
    """A mode in which tensors are fake (shapes only), as in a rehearsal: e.g. to build a big model cheaply."""
    return _Recorder(None)


@contextlib.contextmanager
def fake_world(world_size: int):
    """This process as rank 0 of a pretend world of ``world_size`` ranks, for as long as the block runs.

    The default process group is torch's ``fake`` backend: every collective
    returns at once, sends nothing and leaves its output as it was. Signature
    decisions go to the fake worlds' own cache (never seen by real runs). On
    exit the group is destroyed and sbp_core's cached groups dropped, so a
    real world can start afterwards. Tensors stay real unless a
    ``Rehearsal``'s mode makes them fake.
    """
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a fake world needs a process without torch.distributed initialised (call it before "
                           "launching ranks, or in a subprocess)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
    try:
        with decisions(_FAKE_DECISIONS):
            yield
    finally:
        forget_groups()
        dist.destroy_process_group()


class Rehearsal:
    """``with Rehearsal(world_size) as r:`` — a fake world of ``world_size`` ranks (this one is rank 0).

    Build modules and inputs inside (they become fake); run each phase of a
    step under ``with r.phase(name) as trace:``. Signature decisions go to a
    cache of their own (shared by rehearsals, never seen by real runs). On
    exit the fake process group is destroyed and sbp_core's cached groups
    dropped, so a real world can start afterwards in this process.
    """

    def __init__(self, world_size: int):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.current = None
        self.global_calls: list = []
        self._names: dict = {}
        self._stack: list = []
        self._live: dict = {}  # storage key -> [bytes, tensors referring to it]
        self._live_bytes = 0
        self._ledger = None
        self._seen = 0
        self._exit = contextlib.ExitStack()

    # -- world and mode ---------------------------------------------------------------------

    def __enter__(self):
        self._exit.enter_context(fake_world(self.world_size))
        try:
            quiet = logging.getLogger("torch._subclasses.fake_tensor")  # a refused layout is reported by raising
            level, quiet.level = quiet.level, logging.CRITICAL
            self._exit.callback(setattr, quiet, "level", level)
            self._exit.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            self._exit.enter_context(_Recorder(self))
            pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module)
            post = torch.nn.modules.module.register_module_forward_hook(self._leave_module)
            self._exit.callback(pre.remove)
            self._exit.callback(post.remove)
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc):
        self._exit.close()

    # -- modules ----------------------------------------------------------------------------

    def name_modules(self, root: torch.nn.Module, prefix: str = "") -> None:
        """Attribute calls inside ``root``'s submodules to their dotted names."""
        for name, mod in root.named_modules(remove_duplicate=False):
            self._names[id(mod)] = f"{prefix}.{name}".strip(".") if name else prefix

    def _enter_module(self, mod, args):
        self._stack.append(self._names.get(id(mod), type(mod).__name__))

    def _leave_module(self, mod, args, out):
        if self._stack:
            self._stack.pop()

    def module(self) -> str:
        return self._stack[-1] if self._stack else ""

    # -- phases -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record one phase of a step; yields its ``PhaseTrace`` (complete after the block)."""
        if self.current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self.current.name!r}")
        trace = PhaseTrace(name)
        start_bytes = self._live_bytes
        trace.peak_bytes = 0
        self.global_calls = []
        with explain() as steps, _ledger.comm_ledger() as book:
            self._ledger, self._seen, self.current = book, 0, trace
            self._base = start_bytes
            try:
                yield trace
            finally:
                self.flush_ledger()
                self.current, self._ledger = None, None
        trace.end_bytes = max(0, self._live_bytes - start_bytes)
        trace.global_ops = self._decisions(self.global_calls, steps)

    def flush_ledger(self) -> None:
        book = self._ledger
        if book is None:
            return
        for rec in book.records[self._seen:]:
            self.current.events.append(Collective(rec.op, rec.ranks, rec.bytes))
        self._seen = len(book.records)

    @staticmethod
    def _decisions(calls, steps) -> list:
        """Pair each global call the mode saw with the dispatcher's explained decision (same order)."""
        steps = [s for s in steps]
        calls = [c for c in calls if c[0] != "aten._local_scalar_dense.default"]
        if len(calls) != len(steps):  # a call the dispatcher did not explain: keep decisions, lose modules
            calls = [(s[0], "", ()) for s in steps]
        out = []
        for (op, module, shapes), (_, actual, required, outs, cost) in zip(calls, steps):
            out.append(GlobalOp(op, module, shapes, tuple(actual), required, tuple(outs or ()), float(cost)))
        return out

    # -- memory -----------------------------------------------------------------------------

    def track(self, t: FakeTensor) -> None:
        """Count ``t``'s storage as live until the last tensor created on it in a phase is gone."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [int(storage.nbytes()), 0]
            self._live_bytes += entry[0]
            if self.current is not None:
                self.current.peak_bytes = max(self.current.peak_bytes, self._live_bytes - self._base)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            del self._live[key]
