"""Placement: a device type plus an N-d array of ranks (the device mesh)."""
from __future__ import annotations

import torch

from . import process_groups


def _as_mesh(ranks):
    """Nested lists/tuples/tensor of ints -> (shape, flat tuple of ranks)."""
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.tolist()
    if isinstance(ranks, int):
        ranks = [ranks]
    if isinstance(ranks, range):
        ranks = list(ranks)

    def walk(node, depth):
        if isinstance(node, (list, tuple, range)):
            items = list(node)
            if not items:
                raise ValueError("a placement's rank array has an empty axis")
            shapes, flats = zip(*(walk(x, depth + 1) for x in items))
            if any(s != shapes[0] for s in shapes):
                raise ValueError(f"a placement's rank array must be rectangular, got {ranks!r}")
            return (len(items),) + shapes[0], sum(flats, ())
        if isinstance(node, bool) or not isinstance(node, int):
            raise TypeError(f"placement ranks must be ints, got {node!r} in {ranks!r}")
        return (), (node,)

    shape, flat = walk(ranks, 0)
    return shape, flat


class Placement:
    """Where a global tensor lives: ``device_type`` and a mesh of ranks.

    ``Placement("cpu", [[0, 1], [2, 3]])`` is a 2x2 mesh; mesh axis 0 runs
    down the rows. Equality and hashing use device type, mesh shape and ranks.
    """

    __slots__ = ("device_type", "shape", "ranks", "_index", "_hash")

    def __init__(self, device_type: str, ranks):
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device type {device_type!r} is not one of ('cpu', 'cuda')")
        shape, flat = _as_mesh(ranks)
        seen = set()
        repeated = sorted({r for r in flat if r in seen or seen.add(r)})
        if repeated:
            raise ValueError(f"placement ranks {list(flat)} repeat rank(s) {repeated}: each rank appears once")
        n = process_groups.world_size()
        bad = [r for r in flat if r < 0 or r >= n]
        if bad:
            raise ValueError(
                f"placement ranks {bad} are not in the world: valid ranks are 0..{n - 1} "
                f"(world size {n})"
            )
        self.device_type = device_type
        self.shape = shape
        self.ranks = flat
        self._index = {r: i for i, r in enumerate(flat)}
        self._hash = hash((device_type, shape, flat))
        process_groups.ensure(self._axis_rank_sets() + [flat])

    def _axis_rank_sets(self) -> list:
        """Every group of ranks along every mesh axis."""
        sets = []
        for axis in range(self.ndim):
            for r in self.ranks:
                if self.coords(r)[axis] == 0:
                    sets.append(self.axis_ranks(axis, r))
        return sets

    # -- mesh geometry -------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def coords(self, rank: int) -> tuple:
        """Mesh coordinates of a member rank."""
        i = self._index[rank]
        out = []
        for n in reversed(self.shape):
            out.append(i % n)
            i //= n
        return tuple(reversed(out))

    def rank_at(self, coords) -> int:
        i = 0
        for c, n in zip(coords, self.shape):
            i = i * n + c
        return self.ranks[i]

    def axis_ranks(self, axis: int, rank: int) -> tuple:
        """Ranks along mesh ``axis`` through ``rank``, in axis order."""
        c = list(self.coords(rank))
        out = []
        for k in range(self.shape[axis]):
            c[axis] = k
            out.append(self.rank_at(c))
        return tuple(out)

    def is_disjoint(self, other: "Placement") -> bool:
        return not (set(self.ranks) & set(other.ranks))

    def device(self) -> torch.device:
        """This rank's device for local tensors."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- process groups --------------------------------------------------
    def group(self, axis: int | None = None):
        """This rank's process group along ``axis`` (all members if ``None``)."""
        me = process_groups.world_rank()
        ranks = self.ranks if axis is None else self.axis_ranks(axis, me)
        return process_groups.group_of(ranks)

    # -- identity ----------------------------------------------------------
    def __eq__(self, other):
        return (
            isinstance(other, Placement)
            and self._hash == other._hash
            and self.device_type == other.device_type
            and self.shape == other.shape
            and self.ranks == other.ranks
        )

    def __hash__(self):
        return self._hash

    def __repr__(self):
        mesh = torch.tensor(self.ranks).reshape(self.shape).tolist()
        return f"placement(type={self.device_type!r}, ranks={mesh})"


def placement(device_type: str = "cpu", ranks=None) -> Placement:
    """``placement("cpu", ranks=[[0, 1], [2, 3]])``; ranks default to the whole world, 1-d."""
    if ranks is None:
        ranks = list(range(process_groups.world_size()))
    return Placement(device_type, ranks)
