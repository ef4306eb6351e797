"""AdamW for dense gradients, lazy Adam for sparse row gradients (embedding tables).

``LazyAdamW(param_groups, lr, betas, eps, weight_decay, dense_state=False)``
is one optimizer for a model with both kinds of parameters, so a trainer,
an LR scheduler and ``toolkit.checkpoint.optimizer_state_dict`` see one
object:

- a parameter whose gradient is dense takes torch's AdamW step
  (``torch.optim.adam.adam`` with decoupled weight decay: the same update as
  ``torch.optim.AdamW``), on global tensors like any other;
- a parameter whose gradient is sparse (``nn.Embedding(sparse=True)``; on
  global tensors a ``sbp_core.SparseGlobalTensor``) takes *lazy Adam* (as
  TensorFlow's ``LazyAdamOptimizer``): only the rows looked up this step
  move; their first and second moments update with the step's row
  gradients (duplicates summed), bias correction uses the parameter's step
  count (the update is ``torch.optim.SparseAdam``'s, eps included), weight
  decay applies to those rows only. Untouched rows keep their
  values and moments. Each rank updates the rows of its own shard of the
  table (``sbp_core.sparse.rows_in_box``); nothing is communicated.

On one device with one pipeline stage the trainer's update passes the
gradients as they left autograd, never wrapped as global tensors
(``step(grads={id(p): g})``, ``sbp_core.step_on_locals``): the same update,
each parameter whole on its device.

Lazy state. By default (``dense_state=False``) a table has moments only for
rows it has looked up: per shard a :class:`RowMoments` (append-only slots
plus a sorted row index), so memory grows with the rows seen, not with the
vocabulary. ``state[p]`` is ``{"step": t, "shards": {key: {"box": [row0,
rows, col0, cols], "index": global row ids, "exp_avg": [n, cols],
"exp_avg_sq": [n, cols]}}}`` with this rank's shard under its box's key: a
checkpoint saves each rank's piece once (plain tensors), and loading into
any layout reads every piece and keeps the rows and columns of the new
shard, so resuming reshards like any other state. ``dense_state=True``
keeps ``exp_avg``/``exp_avg_sq`` laid out like the table (zeros where never
looked up), saved and resharded as global tensors.
"""
from __future__ import annotations

import math

import torch
from torch.optim.adam import adam

from sbp_core import GlobalTensor
from sbp_core.local_step import updates_locally
from sbp_core.layout import local_box
from sbp_core.process_groups import world_rank
from sbp_core.sparse import rows_in_box


def _box(p) -> tuple:
    """``((row0, rows), (col0, cols))`` of this rank's shard of a 2-d table (the whole table on one device)."""
    if isinstance(p, GlobalTensor):
        return local_box(p.shape, p.placement.shape, p.sbp, p.placement.coords(world_rank()))
    return tuple((0, n) for n in p.shape)


def _rows_of(p, grad) -> tuple:
    """This rank's ``(local rows, row gradients)`` of a sparse gradient."""
    if isinstance(p, GlobalTensor):
        coords = p.placement.coords(world_rank())
        return rows_in_box(grad, p.shape, p.placement.shape, p.sbp, coords)
    return rows_in_box(grad, p.shape, (), (), ())


def _shard(t):
    """This rank's shard of ``t`` (its ``_local``, the same storage: steps run without autograd, so not
    through ``to_local``'s autograd function)."""
    return t._local if isinstance(t, GlobalTensor) else t


class RowMoments:
    """Adam moments for the rows of one table shard that have been looked up.

    Slots are handed out in order of first look-up (append-only buffers that
    double when full); ``sorted_rows``/``slot_of_sorted`` find a row's slot
    by binary search. ``index[s]`` is slot ``s``'s *global* row id.
    """

    def __init__(self, box, dtype, device):
        (self.row0, self.n_rows), (self.col0, self.n_cols) = box
        self.n = 0
        self._index = torch.empty(0, dtype=torch.int64, device=device)
        self._m = torch.empty(0, self.n_cols, dtype=dtype, device=device)
        self._v = torch.empty(0, self.n_cols, dtype=dtype, device=device)
        self.sorted_rows = torch.empty(0, dtype=torch.int64, device=device)
        self.slot_of_sorted = torch.empty(0, dtype=torch.int64, device=device)

    def _grow(self, need: int) -> None:
        cap = self._index.shape[0]
        if need <= cap:
            return
        new = max(need, 2 * cap, 1024)
        pad = new - cap
        self._index = torch.cat([self._index, self._index.new_zeros(pad)])
        self._m = torch.cat([self._m, self._m.new_zeros(pad, self.n_cols)])
        self._v = torch.cat([self._v, self._v.new_zeros(pad, self.n_cols)])

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Slots of the local ``rows`` (unique, ascending), adding the rows seen for the first time.

        One host read, the number of new rows (it sizes the buffers), and no boolean masks: on a GPU
        the step waits for the device once here, not at every masked index.
        """
        g = rows + self.row0
        n = self.n
        if n:
            pos = torch.searchsorted(self.sorted_rows, g).clamp_(max=n - 1)
            found = self.sorted_rows[pos] == g
            slots = torch.where(found, self.slot_of_sorted[pos], -1)
        else:
            found = torch.zeros_like(g, dtype=torch.bool)
            slots = torch.full_like(g, -1)
        k = g.numel() - int(found.sum())
        if k:
            # The new rows in ascending order: a stable sort puts the rows not found first, as they came.
            first = torch.sort(found.to(torch.uint8), stable=True).indices[:k]
            new, new_slots = g[first], torch.arange(n, n + k, device=g.device)
            slots[first] = new_slots
            self._grow(n + k)
            self._index[n:n + k] = new
            # Merge into the sorted index, O(n + k): a row's place is its rank among its own rows plus
            # the other side's rows below it (the two sides share no row).
            at_new = torch.searchsorted(self.sorted_rows, new) + torch.arange(k, device=g.device)
            at_old = torch.searchsorted(new, self.sorted_rows) + torch.arange(n, device=g.device)
            merged_rows = torch.empty(n + k, dtype=torch.int64, device=g.device)
            merged_slots = torch.empty_like(merged_rows)
            merged_rows[at_old], merged_rows[at_new] = self.sorted_rows, new
            merged_slots[at_old], merged_slots[at_new] = self.slot_of_sorted, new_slots
            self.sorted_rows, self.slot_of_sorted = merged_rows, merged_slots
            self.n = n + k
        return slots

    @property
    def exp_avg(self) -> torch.Tensor:
        return self._m[:self.n]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self._v[:self.n]

    def piece(self) -> dict:
        """This shard's state for a checkpoint (views, no copies)."""
        return {"box": [self.row0, self.n_rows, self.col0, self.n_cols], "index": self._index[:self.n],
                "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def key(self) -> str:
        return f"{self.row0}:{self.col0}"

    def absorb(self, pieces: dict) -> None:
        """Take the rows and columns of this shard from saved pieces of any layout, on any device (a
        checkpoint loads them on the host; the moments live on the parameter's device)."""
        here = self._m.device
        for piece in pieces.values():
            r0, nr, c0, nc = (int(v) for v in piece["box"])
            lo, hi = max(c0, self.col0), min(c0 + nc, self.col0 + self.n_cols)
            index = piece["index"].to(here, torch.int64)
            keep = (index >= self.row0) & (index < self.row0 + self.n_rows)
            if hi <= lo or not bool(keep.any()):
                continue
            rows = index[keep] - self.row0
            order = torch.argsort(rows)
            slots = self.slots(rows[order])
            for name, buf in (("exp_avg", self._m), ("exp_avg_sq", self._v)):
                vals = piece[name].to(here)[keep][order].to(buf.dtype)
                buf[slots, lo - self.col0:hi - self.col0] = vals[:, lo - c0:hi - c0]


class LazyAdamW(torch.optim.Optimizer):
    """See the module docstring. Groups may set ``dense_state`` per group."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 dense_state: bool = False):
        if not lr > 0:
            raise ValueError(f"lr={lr!r}: must be > 0")
        if len(tuple(betas)) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas!r}: must be two numbers in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      dense_state=dense_state))
        self._moments: dict = {}  # id(param) -> RowMoments

    #: ``step(grads=...)`` takes a one-device step's gradients as they left autograd, dense and sparse
    #: (``sbp_core.step_on_locals(optimizer, grads)``).
    takes_local_grads = True

    @torch.no_grad()
    def step(self, closure=None, grads: dict | None = None):
        """One step. ``grads``: ``{id(parameter): its gradient or None}`` used instead of each parameter's
        ``.grad``: plain tensors (dense, or sparse row gradients) of a one-device step that never became
        global (``sbp_core.LocalParameters.restore(hand_grads=False)``); every parameter is then whole on
        its one device, so its local is the whole parameter (``ValueError`` for one laid out partial)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if grads is None:
                got = [(p, p.grad) for p in group["params"]]
            else:
                got = [(p, grads.get(id(p))) for p in group["params"]]
                partial = [p for p, _ in got if isinstance(p, GlobalTensor) and any(s.is_partial for s in p.sbp)]
                if partial:
                    raise ValueError("a parameter laid out partial cannot take a local gradient: hand the "
                                     "gradients to the parameters")
            dense = [(p, g) for p, g in got if g is not None and not g.is_sparse]
            if dense:
                self._dense_step(group, [p for p, _ in dense], [g for _, g in dense], local=grads is not None)
            for p, g in got:
                if g is not None and g.is_sparse:
                    self._lazy_step(group, p, g)
        return loss

    def _dense_step(self, group, params, grads, local: bool = False) -> None:
        m, v, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            steps.append(st["step"])
        b1, b2 = group["betas"]
        tensors = [list(params), list(grads), m, v]
        if local or all(updates_locally(p) for p in params):
            # An element-wise update of tensors sharing one layout is their locals' update
            # (sbp_core.local_step): no op dispatch per parameter.
            tensors = [[t._local if isinstance(t, GlobalTensor) else t for t in ts] for ts in tensors]
        # foreach on CUDA for plain tensors only: its _foreach_* ops have no SBP rule.
        foreach = tensors[0][0].device.type == "cuda" and not any(isinstance(t, GlobalTensor) for t in tensors[0])
        adam(*tensors, [], steps, foreach=foreach, decoupled_weight_decay=True, amsgrad=False,
             beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)

    def _lazy_step(self, group, p, grad) -> None:
        if p.dim() != 2:
            raise ValueError(f"lazy Adam updates rows of 2-d tables; a parameter of shape {tuple(p.shape)} "
                             "has a sparse gradient")
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            if group["dense_state"]:
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
        st["step"] += 1
        t = float(st["step"])
        rows, g = _rows_of(p, grad)
        if group["dense_state"]:
            m_all, v_all = _shard(st["exp_avg"]), _shard(st["exp_avg_sq"])
            m, v = m_all[rows], v_all[rows]
        else:
            moments = self._row_moments(p)
            slots = moments.slots(rows)
            m, v = moments._m[slots], moments._v[slots]
        b1, b2 = group["betas"]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if group["dense_state"]:
            m_all[rows], v_all[rows] = m, v
        else:
            moments._m[slots], moments._v[slots] = m, v
            st["shards"] = {moments.key(): moments.piece()}
        local = _shard(p)
        w = local[rows]
        if group["weight_decay"]:
            w.mul_(1 - group["lr"] * group["weight_decay"])
        # torch.optim.SparseAdam's form: eps added to sqrt(v) before the bias correction.
        denom = v.sqrt().add_(group["eps"])
        w.addcdiv_(m, denom, value=-group["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
        local[rows] = w

    def _row_moments(self, p) -> RowMoments:
        moments = self._moments.get(id(p))
        if moments is None:
            moments = self._moments[id(p)] = RowMoments(_box(p), p.dtype, _shard(p).device)
        return moments

    def load_state_dict(self, state_dict: dict) -> None:
        """Like ``torch.optim.Optimizer.load_state_dict``; lazy pieces of any layout go to this rank's shard."""
        state = dict(state_dict["state"])
        pieces = {}
        for k, s in list(state.items()):
            if isinstance(s, dict) and "shards" in s:
                pieces[k] = s["shards"]
                state[k] = {key: v for key, v in s.items() if key != "shards"}
        super().load_state_dict({**state_dict, "state": state})
        params = [p for group in self.param_groups for p in group["params"]]
        self._moments = {}
        for k, saved in pieces.items():
            p = params[int(k)]
            moments = self._row_moments(p)
            moments.absorb(saved)
            self.state[p]["shards"] = {moments.key(): moments.piece()}
