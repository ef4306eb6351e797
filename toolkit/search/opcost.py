"""What one local aten call costs: measured on this machine, or a roofline for a modelled device.

Both price an ``OpCall`` (op name and argument specs, see ``rehearsal``) in
seconds:

- ``MeasuredOpCosts``: runs the call on this machine's CPU with freshly
  made tensors of the recorded shapes, strides and dtypes (floats random,
  integers zero so that indices are valid), on one intra-op thread, and
  keeps the least *CPU time of the calling thread* over a few repeats: the
  work the call needs, which other jobs on a shared machine do not inflate
  the way they inflate wall time (the simulator turns work into time with
  the machine's measured capacity). Results are cached in a JSON file, so
  each distinct call is measured once (or once per process, ``refresh``).
- ``RooflineOpCosts``: ``max(FLOPs / peak FLOP/s of the dtype, bytes /
  memory bandwidth) + kernel launch overhead``. FLOPs come from torch's own
  formulas (``torch.utils.flop_counter``, run on meta tensors) plus the CPU
  flash-attention kernels it lacks; bytes are the tensors read and written.
  A view (an op returning an alias it does not write) costs nothing.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import flop_counter

from .rehearsal import OpCall, TensorSpec

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def resolve_op(name: str):
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _tensor(spec: TensorSpec, device: str):
    dtype = _DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"dtype {spec.dtype!r} of an op argument is not one of {sorted(_DTYPES)}")
    t = torch.empty_strided(spec.shape, spec.stride, dtype=dtype, device=device)
    if device != "meta":
        # Fill the storage through a flat view: an expanded argument (a stride of 0) has elements that
        # share memory, which an in-place fill of ``t`` itself refuses.
        flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        if dtype.is_floating_point:
            flat.normal_()
        else:
            flat.zero_()
    return t


def build_args(spec, device: str = "cpu"):
    """Rebuild an argument from its spec (see ``rehearsal.spec_of``)."""
    if isinstance(spec, TensorSpec):
        return _tensor(spec, device)
    if isinstance(spec, tuple):
        if len(spec) == 2 and spec[0] == "dtype":
            return _DTYPES[spec[1]]
        if len(spec) == 2 and spec[0] == "device":
            return torch.device(device)
        if len(spec) == 2 and spec[0] in ("memory_format", "layout"):
            return getattr(torch, spec[1])
        if len(spec) == 2 and spec[0] == "opaque":
            raise ValueError(f"an argument of type {spec[1]} cannot be rebuilt")
        return [build_args(s, device) for s in spec]
    return spec


def call_args(call: OpCall, device: str):
    """``(op, args, kwargs)`` of ``call`` with tensors made on ``device``."""
    pos, kw = call.args
    return resolve_op(call.op), build_args(pos, device), {k: build_args(v, device) for k, v in kw}


def measurement_cache(threads: int = 1) -> Path:
    """This host's cache of per-call measurements: seconds with one thread, or the gain of ``threads`` threads.

    ``$SBP_CACHE_DIR`` (default ``~/.cache/sbp-recipes``)``/op-costs-<host>.json``, and
    ``op-costs-<host>-threads<n>.json`` for ``threadgain.MeasuredThreadGain``.
    """
    cache = Path(os.environ.get("SBP_CACHE_DIR", "~/.cache/sbp-recipes")).expanduser()
    tail = "" if threads == 1 else f"-threads{threads}"
    return cache / f"op-costs-{socket.gethostname()}{tail}.json"


def is_view(func) -> bool:
    """True for an op that returns an alias of an input without writing it (``view``, ``t``, ``slice``...)."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


class MeasuredOpCosts:
    """CPU seconds of each local call on this machine with ``threads`` intra-op threads (use 1), cached in ``path``."""

    def __init__(self, path: str | os.PathLike, threads: int = 1, repeats: int = 5, budget_s: float = 0.05,
                 refresh: bool = False):
        """``refresh``: measure each call again on its first use here, replacing the file's value.

        The file's entries were each measured under whatever load the machine had then (gpt2-tiny's
        calls summed to 1.2-1.4x their quiet values there); a caller that scales them by a factor
        measured now (``toolkit.search.kernel_factor``) needs them measured now too.
        """
        self.path = Path(path)
        self.threads = threads
        self.repeats, self.budget_s = repeats, budget_s
        self.refresh = refresh
        self._table: dict = {}  # repr(call key) -> seconds, as stored on disk
        self._hot: dict = {}  # call key -> seconds, for lookups without repr
        if self.path.exists():
            self._table = json.loads(self.path.read_text())
        self._dirty = False

    def seconds(self, call: OpCall) -> float:
        got = self._hot.get(call.key)
        if got is None:
            key = repr(call.key)
            got = None if self.refresh else self._table.get(key)
            if got is None:
                got = self._table[key] = self.measure(call)
                self._dirty = True
            self._hot[call.key] = got
        return got

    def measure(self, call: OpCall) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            func, args, kwargs = call_args(call, "cpu")
            func(*args, **kwargs)  # warm up (allocator, lazy init)
            best, spent, n = float("inf"), 0.0, 0
            while n < self.repeats or (spent < self.budget_s and n < 50):
                func_args, func_kwargs = (call_args(call, "cpu")[1:] if _writes(func) else (args, kwargs))
                t0 = time.thread_time_ns()
                func(*func_args, **func_kwargs)
                dt = (time.thread_time_ns() - t0) * 1e-9
                best, spent, n = min(best, dt), spent + dt, n + 1
            return best
        finally:
            torch.set_num_threads(before)

    def save(self) -> None:
        """Write new measurements to the cache file (atomically)."""
        if self._dirty:
            save_table(self.path, self._table)
            self._dirty = False


def save_table(path: Path, table: dict) -> None:
    """Write a measurement cache (``{repr(call key): value}``) to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f)
    os.replace(tmp, path)


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


_EXTRA_FLOPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default":
        lambda a: flop_counter.sdpa_flop_count(a[0].shape, a[1].shape, a[2].shape),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default":
        lambda a: flop_counter.sdpa_backward_flop_count(a[0].shape, a[1].shape, a[2].shape, a[3].shape),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class RooflineOpCosts:
    """``max(FLOPs / peak, bytes / bandwidth) + overhead`` per call on a modelled device.

    ``peak_flops``: FLOP/s by dtype name (``float32``, ``bfloat16``, ...; the
    float32 entry also prices integer and boolean work); ``mem_bandwidth``:
    bytes/s; ``overhead``: seconds per kernel launch.
    """

    def __init__(self, peak_flops: dict, mem_bandwidth: float, overhead: float = 0.0):
        self.peak_flops, self.mem_bandwidth, self.overhead = dict(peak_flops), float(mem_bandwidth), float(overhead)
        self._table: dict = {}

    def flops_bytes(self, call: OpCall) -> tuple:
        """``(FLOPs, bytes read and written, dtype of the work)`` of ``call``."""
        func, args, kwargs = call_args(call, "meta")
        if is_view(func):
            return 0, 0, "float32"
        try:
            with flop_counter.FlopCounterMode(display=False) as counter:
                out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # no meta kernel (e.g. ``item``): a host-side read
            return 0, _nbytes(args), "float32"
        flops = counter.get_total_flops() or (_EXTRA_FLOPS[call.op](args) if call.op in _EXTRA_FLOPS else 0)
        dtypes = [t.dtype for t in args if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
        dtype = str(dtypes[0]).removeprefix("torch.") if dtypes else "float32"
        written = 0 if _writes(func) else _nbytes(out)  # in place: the output is an input already counted
        return flops, _nbytes(args) + _nbytes(list(kwargs.values())) + written, dtype

    def seconds(self, call: OpCall) -> float:
        key = call.key
        got = self._table.get(key)
        if got is None:
            flops, nbytes, dtype = self.flops_bytes(call)
            if flops == 0 and nbytes == 0:
                got = 0.0
            else:
                peak = self.peak_flops.get(dtype, self.peak_flops["float32"])
                got = max(flops / peak, nbytes / self.mem_bandwidth) + self.overhead
            self._table[key] = got
        return got

    def save(self) -> None:  # nothing to keep: a roofline is computed, not measured
        pass
