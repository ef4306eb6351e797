"""Feature hashing: raw categorical values -> rows of the embedding tables.

Every categorical value is hashed, whatever it is (an 8-hex-digit Criteo
token, any other string, an integer id of any size, or missing), so a value
never indexes outside the table: there is no vocabulary to build and no
index error for ids beyond ``V``.

Two table layouts (``FeatureHasher``):

- one shared vocabulary: ``vocab_size=V``; field ``f``'s value ``x`` goes to
  row ``h(x, f) mod V`` (fields share the rows; the field is mixed into the
  hash so equal values of different fields land apart);
- per field: ``field_vocab_sizes=[V_0, ..., V_{F-1}]``; field ``f`` owns rows
  ``[o_f, o_f + V_f)`` with ``o_f = V_0 + ... + V_{f-1}``, and ``x`` goes to
  ``o_f + h(x, f) mod V_f``.

Either way the model sees one table of ``rows`` rows. ``h`` is splitmix64
of the value's 64-bit key xor a per-field salt: keys are the value itself
for integers (two's complement), ``int(s, 16)`` for hex strings of up to 16
digits, the first 8 bytes of BLAKE2b for other strings, and a fixed key for
missing values (``None``, ``""``).
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

MISSING_KEY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_HEX = set("0123456789abcdefABCDEF")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of uint64 ``x`` (vectorised; wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def value_key(value) -> int:
    """The 64-bit key of one raw categorical value (see the module docstring)."""
    if value is None:
        return int(MISSING_KEY)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value) & 0xFFFF_FFFF_FFFF_FFFF
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    s = str(value)
    if not s:
        return int(MISSING_KEY)
    if len(s) <= 16 and set(s) <= _HEX:
        return int(s, 16)
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def keys_of(values) -> np.ndarray:
    """uint64 keys of a ``[n, fields]`` array/list of raw values (integer arrays pass through)."""
    arr = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64).view(np.uint64) if arr.dtype.kind == "i" else arr.astype(np.uint64)
    return np.array([[value_key(v) for v in row] for row in values], dtype=np.uint64).reshape(len(values), -1)


class FeatureHasher:
    """Maps ``[n, n_fields]`` raw values to int64 table rows in ``[0, rows)``."""

    def __init__(self, n_fields: int, vocab_size: int | None = None, field_vocab_sizes=None, seed: int = 0):
        if (vocab_size is None) == (field_vocab_sizes is None):
            raise ValueError("give exactly one of vocab_size (one shared vocabulary) and field_vocab_sizes "
                             f"(one per field); got vocab_size={vocab_size!r}, field_vocab_sizes={field_vocab_sizes!r}")
        if field_vocab_sizes is not None:
            sizes = [int(v) for v in field_vocab_sizes]
            if len(sizes) != n_fields:
                raise ValueError(f"field_vocab_sizes lists {len(sizes)} sizes for {n_fields} categorical fields")
            offsets = np.cumsum([0] + sizes[:-1])
        else:
            sizes, offsets = [int(vocab_size)] * n_fields, [0] * n_fields
        if any(v < 1 for v in sizes):
            raise ValueError(f"vocabulary sizes must be >= 1, got {sizes}")
        self.n_fields = n_fields
        self.sizes = np.asarray(sizes, dtype=np.uint64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.rows = int(sum(sizes)) if field_vocab_sizes is not None else int(vocab_size)
        self.salts = splitmix64(np.arange(n_fields, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 20))

    def __call__(self, values) -> torch.Tensor:
        keys = keys_of(values)
        if keys.ndim != 2 or keys.shape[1] != self.n_fields:
            raise ValueError(f"expected raw values of shape [n, {self.n_fields}], got {list(keys.shape)}")
        h = splitmix64(keys ^ self.salts[None, :]) % self.sizes[None, :]
        return torch.from_numpy(h.astype(np.int64) + self.offsets[None, :])
