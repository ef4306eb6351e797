"""A training state as a tree: tensor leaves go to storage, everything else to tagged JSON.

A state is nested dicts, lists and tuples whose leaves are tensors (global
or plain) or plain values. :func:`encode` splits it into ``{fqn: tensor}``
and a JSON skeleton in which each tensor is a placeholder
``{"$t": "tensor", "fqn": ...}``; :func:`decode` turns a skeleton back into
Python values with :class:`Saved` placeholders where tensors were.

A leaf's fqn is its path: tokens joined by ``/``. A string key is its own
token (``%`` and ``/`` percent-escaped, and a leading ``#`` or ``~``), an
int key is ``#<n>``, a list position its index; ``~rank<r>`` prefixes a
rank's own entries (see ``save``'s ``per_rank``). So
``state["model"]["transformer.h.0.attn.c_attn.weight"]`` is
``model/transformer.h.0.attn.c_attn.weight`` and AdamW's ``exp_avg`` of
that parameter ``optim/state/transformer.h.0.attn.c_attn.weight/exp_avg``.

JSON round-trips these values exactly: floats by their shortest repr, ints
at any size; tuples, bytes, ``torch.dtype``, numpy arrays and dicts with
non-string keys are tagged (``"$t"``) so they come back as what they were.
Other objects raise ``TypeError`` naming their path: a checkpoint stores
data, never code, so loading one runs nothing.
"""
from __future__ import annotations

import base64

import torch

TAG = "$t"


class Saved:
    """Where a checkpoint holds a tensor: its fqn (shape and dtype come from the storage metadata)."""

    __slots__ = ("fqn",)

    def __init__(self, fqn: str):
        self.fqn = fqn

    def __repr__(self):
        return f"Saved({self.fqn!r})"


def key_token(key) -> str:
    """The path token of a dict key (see the module docstring)."""
    if isinstance(key, str):
        tok = key.replace("%", "%25").replace("/", "%2F")
        if tok[:1] in ("#", "~"):
            tok = f"%{ord(tok[0]):02X}" + tok[1:]
        return tok
    if isinstance(key, int) and not isinstance(key, bool):
        return f"#{key}"
    return "?" + repr(key).replace("%", "%25").replace("/", "%2F")


def rank_token(rank: int) -> str:
    return f"~rank{rank}"


def join(tokens) -> str:
    return "/".join(tokens)


def is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def encode(obj, tokens: list, tensors: dict, skip=lambda obj: False):
    """JSON skeleton of ``obj``; its tensors go into ``tensors`` keyed by fqn.

    ``skip(obj)`` true: the value is encoded as an empty dict (a slot with no
    state yet, e.g. an optimizer's parameter before its first step).
    """
    if skip(obj):
        return {}
    if is_tensor(obj):
        fqn = join(tokens)
        tensors[fqn] = obj
        return {TAG: "tensor", "fqn": fqn}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: encode(v, tokens + [key_token(k)], tensors, skip) for k, v in obj.items()}
        return {TAG: "dict", "items": [[encode(k, tokens, {}, skip), encode(v, tokens + [key_token(k)], tensors, skip)]
                                       for k, v in obj.items()]}
    if isinstance(obj, list):
        return [encode(v, tokens + [str(i)], tensors, skip) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [encode(v, tokens + [str(i)], tensors, skip) for i, v in enumerate(obj)]}
    if isinstance(obj, (bytes, bytearray)):
        return {TAG: "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {TAG: "dtype", "name": str(obj).removeprefix("torch.")}
    if type(obj).__module__ == "numpy":
        if getattr(obj, "shape", None) == () and hasattr(obj, "item"):
            return encode(obj.item(), tokens, tensors, skip)
        if hasattr(obj, "tolist") and hasattr(obj, "dtype"):
            return {TAG: "ndarray", "dtype": str(obj.dtype), "data": obj.tolist()}
    raise TypeError(
        f"state value at {join(tokens) or '<root>'!r} is a {type(obj).__module__}.{type(obj).__qualname__}: "
        "a checkpoint holds tensors and plain data (dict, list, tuple, str, int, float, bool, None, bytes, "
        "torch.dtype, numpy arrays), never objects that would run code when loaded"
    )


def decode(node):
    """Python values from a skeleton; tensors become :class:`Saved` placeholders."""
    if isinstance(node, list):
        return [decode(v) for v in node]
    if not isinstance(node, dict):
        return node
    tag = node.get(TAG)
    if tag is None:
        return {k: decode(v) for k, v in node.items()}
    if tag == "tensor":
        return Saved(node["fqn"])
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in node["items"]}
    if tag == "tuple":
        return tuple(decode(v) for v in node["items"])
    if tag == "bytes":
        return base64.b64decode(node["b64"])
    if tag == "dtype":
        dtype = getattr(torch, node["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {node['name']!r} in checkpoint state")
        return dtype
    if tag == "ndarray":
        import numpy as np

        return np.asarray(node["data"], dtype=node["dtype"])
    raise ValueError(f"unknown tag {tag!r} in checkpoint state (valid: tensor, dict, tuple, bytes, dtype, ndarray)")


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


def merge(a, b):
    """Union of two skeletons: dicts merge key by key, anything else keeps ``a`` (the lower rank's)."""
    if isinstance(a, dict) and isinstance(b, dict) and TAG not in a and TAG not in b:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if k in a else v
        return out
    return a


def holds_tensor(obj) -> bool:
    """Whether ``obj`` holds a tensor (in a state) or a saved tensor's place (in a decoded tree)."""
    if is_tensor(obj) or isinstance(obj, Saved):
        return True
    if isinstance(obj, dict):
        return any(holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v) for v in obj)
    return False
