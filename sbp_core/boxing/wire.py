"""How a tensor of any dtype crosses the backends: ``moved`` for transfers, ``summable`` and ``reduced`` for
reductions, ``dumps`` for host messages that hold tensors.

gloo and NCCL each take only some dtypes. Both take the ones in ``NATIVE``.
gloo refuses int16, the unsigned 16-64 bit integers and the float8 types
("Invalid scalar type"). NCCL has no 16-bit integer type, and torch hands it
complex and float8 tensors only in some of its calls.

- **Transfers** (all-gather, all-to-all, send/receive) change no value, so
  any other dtype travels as its bytes. ``moved(t)`` is a ``uint8`` view that
  shares ``t``'s memory: ``t``'s shape plus one trailing dim of
  ``t.element_size()`` bytes. Dim-0 pieces and split sizes count what they
  counted before, and a receive buffer filled through the view is filled in
  its own dtype. The bytes sent are ``t``'s: the ledger's count holds.
- **Reductions** (all-reduce, reduce-scatter, reduce) compute.
  ``summable(dtype, op)`` names the dtype a reduction runs in: the dtype
  itself when the backends reduce it, else the next wider integer one
  (int16 and uint16 as int32, uint32 as int64; bool sums as int32 too,
  since gloo adds its bytes into values that are not bools). The result is
  cast back, so sums wrap as they would in the narrow dtype and a bool sum
  is a logical or. A wider reduction sends the wider bytes, and the ledger
  records those. A dtype with no such form (uint64, float8; complex for max
  and min) is refused before anything is sent, with a ``TypeError`` that
  names it. ``reduced(t)`` is what a reduction hands the backend: complex
  tensors as their real and imaginary parts (``torch.view_as_real``, which
  torch itself does in some calls and not in ``reduce`` or
  ``reduce_scatter_tensor``).
- **Host messages** are pickles. torch pickles uint16-64 and float8 tensors
  but cannot unpickle them (its storage rebuild asks ``UntypedStorage`` for
  a dtype; torch 2.11 and 2.13). ``dumps`` pickles those as their bytes, and
  plain ``pickle.loads`` rebuilds them. It pickles a CUDA tensor as a host
  copy that ``pickle.loads`` puts on the receiver's current GPU, where torch
  would put it on the sender's GPU index.
"""
from __future__ import annotations

import io
import pickle

import torch

NATIVE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool})
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def moved(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backends move it: ``t`` itself, or a ``uint8`` view of its bytes (shares its memory;
    ``t`` must have a unit last stride, as every contiguous tensor has)."""
    return t if t.dtype in NATIVE else t.unsqueeze(-1).view(torch.uint8)


def summable(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype a reduction with ``op`` of ``dtype`` runs in (see the module docstring); ``TypeError`` where none does."""
    if dtype == torch.bool and op == "sum":
        return torch.int32
    if dtype in NATIVE or (dtype.is_complex and op == "sum"):
        return dtype
    if dtype in _WIDER:
        return _WIDER[dtype]
    raise TypeError(f"sbp_core cannot reduce {dtype} tensors across ranks with {op} (a partial value's "
                    f"{op}): neither gloo nor NCCL reduces it, and it has no wider exact form. Cast the partial "
                    f"value to a dtype they reduce (for example float32 or int64) first.")


def reduces_as_is(dtype: torch.dtype, op: str) -> bool:
    """Whether a reduction with ``op`` hands ``dtype`` to the backends as it is (no wider dtype, no real view)."""
    return dtype in NATIVE and summable(dtype, op) == dtype


def reduced(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a reduction hands it to the backend: ``t``, or its real view when complex (shares its memory)."""
    return torch.view_as_real(t) if t.is_complex() else t


_UNPICKLED = frozenset({torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                        torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def _here(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: a CUDA tensor goes to the receiver's current GPU, whichever
    index it had on the sender (ranks on one machine each use a GPU of their own)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _from_bytes(data: bytes, dtype: str, shape, device_type: str) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape).to(_here(device_type))


def _from_host(t: torch.Tensor, device_type: str, requires_grad: bool, parameter: bool = False) -> torch.Tensor:
    t = t.to(_here(device_type))
    return torch.nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.dtype in _UNPICKLED:
            data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _from_bytes, (data, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), obj.device.type)
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cuda":
            # torch pickles a CUDA tensor with its device index, which on the receiver may be another rank's
            # GPU. (Other subclasses pickle as they define: a global tensor's local comes back through here.)
            return _from_host, (obj.detach().cpu(), "cuda", obj.requires_grad, type(obj) is torch.nn.Parameter)
        return NotImplemented


def dumps(obj) -> bytes:
    """``pickle.dumps(obj)``, with the tensors torch cannot unpickle (see above) carried as bytes and CUDA
    tensors as host copies, so that ``pickle.loads`` gives them back: same dtype, shape and values, on the
    loading rank's device of the same type (``requires_grad`` kept for CUDA tensors, not for the bytes)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
