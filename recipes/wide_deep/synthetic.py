"""Criteo-shaped samples from a planted logistic model: learning is measurable, the ceiling is known.

``PlantedCriteo(n_rows, seed, ...)`` is an indexable data set in which row
``i`` is a pure function of ``(seed, i)`` (counter-based: splitmix64 of the
row and feature index), so any rank reads any rows without generating or
storing the others, on any machine, offline.

Row ``i`` has, like Criteo:

- 13 dense counts ``x_j = floor(exp(dense_spread * z))`` with ``z ~ N(0, 1)``,
  missing (0) with probability ``missing``;
- 26 categorical values ``v_f`` in ``[0, C_f)``, log-uniform (``P(v) ~
  1/(v+1)``, a Zipf head like real click logs); cardinalities ``C_f`` are
  geometric from ``min_cardinality`` to ``max_cardinality`` over the fields;
- a click ``y ~ Bernoulli(sigmoid(logit))`` with the planted logistic model
  ``logit = bias + sum_j beta_j * (log1p(x_j) - mean_j) + sum_f (theta_f[v_f] - mean_f)``,
  ``beta_j ~ N(0, dense_weight^2)`` and ``theta_f[v] ~ N(0, cat_weight^2)``
  (each weight also a function of the seed; the means are over the value
  distributions, so ``bias`` sets the click rate).

The model sees ``log1p(x)`` and the hashed ``v_f``; the planted logit is
linear in those (the wide part alone can represent it given enough rows
and few hash collisions). ``prob`` is the true click probability, so the
Bayes AUC of a held-out set is the AUC of ``prob`` against its labels.

Training reads the rows back from a cache written once
(``planted_cache.py``), not from ``generate``.
"""
from __future__ import annotations

import numpy as np
import torch

from .hashing import splitmix64

_UNIT = 2.0 ** -53
VERSION = 1  # of the rows ``generate`` draws: a change of it makes new cache directories


def _salt(seed: int, stream: int) -> np.uint64:
    """The key of random stream ``stream`` of data set ``seed``, xored into each index of the stream."""
    return splitmix64(np.asarray([seed * 1_000_003 + stream], dtype=np.uint64))[0]


def _units(keys: np.ndarray) -> torch.Tensor:
    """U(0, 1) float64, one per ``keys`` element (an index xored with its stream's salt): the top 53 bits of
    its splitmix64, plus a half, times 2**-53 (exact in float64, so any grouping of keys gives the same
    values)."""
    bits = splitmix64(keys) >> np.uint64(11)
    return torch.from_numpy((bits.astype(np.float64) + 0.5) * _UNIT)


def _uniform(seed: int, stream: int, index: np.ndarray) -> torch.Tensor:
    """U(0, 1) float64, one per ``index`` (uint64), from ``(seed, stream)``."""
    return _units(index.astype(np.uint64) ^ _salt(seed, stream))


def _normal(seed: int, stream: int, index: np.ndarray) -> torch.Tensor:
    return torch.special.ndtri(_uniform(seed, stream, index))


class PlantedCriteo:
    """Rows ``[0, n_rows)`` of the planted data set (see the module docstring)."""

    def __init__(self, n_rows: int, seed: int = 0, n_dense: int = 13, n_fields: int = 26,
                 min_cardinality: int = 2, max_cardinality: int = 1000, cat_weight: float = 0.3,
                 dense_weight: float = 0.3, bias: float = -1.45, dense_spread: float = 1.5, missing: float = 0.1):
        if n_rows < 1 or n_dense < 0 or n_fields < 1:
            raise ValueError(f"n_rows={n_rows}, n_dense={n_dense}, n_fields={n_fields}: need n_rows, n_fields >= 1")
        if not 1 <= min_cardinality <= max_cardinality:
            raise ValueError(f"cardinalities {min_cardinality}..{max_cardinality}: need 1 <= min <= max")
        self.n_rows, self.seed, self.n_dense, self.n_fields = int(n_rows), int(seed), n_dense, n_fields
        self.params = dict(n_rows=self.n_rows, seed=self.seed, n_dense=n_dense, n_fields=n_fields,
                           min_cardinality=min_cardinality, max_cardinality=max_cardinality, cat_weight=cat_weight,
                           dense_weight=dense_weight, bias=bias, dense_spread=dense_spread, missing=missing)
        ratio = (max_cardinality / min_cardinality) ** (1 / max(n_fields - 1, 1))
        self.cardinality = torch.tensor([round(min_cardinality * ratio ** f) for f in range(n_fields)],
                                        dtype=torch.float64)
        self.cat_weight, self.bias, self.dense_spread, self.missing = cat_weight, bias, dense_spread, missing
        self.beta = _normal(self.seed, 1, np.arange(n_dense)) * dense_weight
        # Centre each field's weights under its value distribution, P(v) = log((v+2)/(v+1)) / log(C+1),
        # so the click rate is set by ``bias``, not by the draw of the few head values' weights.
        self.theta_mean = torch.zeros(n_fields, dtype=torch.float64)
        for f in range(n_fields):
            v = torch.arange(int(self.cardinality[f]), dtype=torch.float64)
            prob = torch.log((v + 2) / (v + 1)) / torch.log(self.cardinality[f] + 1)
            index = v.numpy().astype(np.uint64) * np.uint64(n_fields) + np.uint64(f)
            self.theta_mean[f] = (prob * _normal(self.seed, 5, index) * cat_weight).sum()
        # E[log1p(floor(exp(s z)))] over z ~ N(0, 1) with missing values, centring the dense terms.
        z = torch.special.ndtri((torch.arange(4096, dtype=torch.float64) + 0.5) / 4096)
        self.dense_mean = (1 - missing) * torch.log1p(torch.floor(torch.exp(dense_spread * z))).mean()
        # What ``generate`` draws with: each stream's salt per column of its first pass, and the columns.
        self._dense_cols = np.arange(n_dense, dtype=np.uint64)[None, :]
        self._field_cols = np.arange(n_fields, dtype=np.uint64)[None, :]
        self._first_salts = np.asarray([_salt(self.seed, 2)] * n_dense + [_salt(self.seed, 3)] * n_dense
                                       + [_salt(self.seed, 4)] * n_fields + [_salt(self.seed, 6)], dtype=np.uint64)
        self._theta_salt = _salt(self.seed, 5)
        self._log_range = torch.log(self.cardinality + 1)

    def __len__(self) -> int:
        return self.n_rows

    def generate(self, rows: torch.Tensor) -> dict:
        """``{"dense": float64 [n, 13] counts, "cats": int64 [n, 26], "label": float32 [n], "prob": float64 [n]}``.

        Two passes of the hash over whole arrays: one over every draw a row
        makes before its categories are known (its dense normals, stream 2;
        missing flags, 3; categories, 4; click, 6), one over the categories'
        weights (5)."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.n_rows):
            raise IndexError(f"rows {int(rows.min())}..{int(rows.max())} outside [0, {self.n_rows})")
        r = rows.numpy().astype(np.uint64)[:, None]
        nd, nf = self.n_dense, self.n_fields
        cells, fields = r * np.uint64(nd) + self._dense_cols, r * np.uint64(nf) + self._field_cols
        u = _units(np.concatenate([cells, cells, fields, r], axis=1) ^ self._first_salts)
        counts = torch.floor(torch.exp(self.dense_spread * torch.special.ndtri(u[:, :nd])))
        counts.masked_fill_(u[:, nd:2 * nd] < self.missing, 0)
        cats = torch.minimum(torch.floor(torch.exp(u[:, 2 * nd:2 * nd + nf] * self._log_range)) - 1,
                             self.cardinality - 1).to(torch.int64)
        theta_keys = (cats.numpy().astype(np.uint64) * np.uint64(nf) + self._field_cols) ^ self._theta_salt
        theta = torch.special.ndtri(_units(theta_keys)) * self.cat_weight
        logit = self.bias + (theta - self.theta_mean).sum(1) + ((torch.log1p(counts) - self.dense_mean) * self.beta).sum(1)
        prob = torch.sigmoid(logit)
        label = (u[:, -1] < prob).to(torch.float32)
        return {"dense": counts, "cats": cats, "label": label, "prob": prob}


def bayes_logloss_floor(prob: torch.Tensor, label: torch.Tensor) -> float:
    """Log loss of the true probabilities (the planted model's own loss) on these rows."""
    p = prob.clamp(1e-12, 1 - 1e-12)
    return float(-(label * torch.log(p) + (1 - label) * torch.log1p(-p)).mean())

