"""Plans: the declarative description of actors, queues, register quotas and edges.

Higher layers (the pipeline executor, the data pipeline) build a ``Plan``;
``validate`` rejects, before anything runs, an input naming no actor, a
quota below 1, an unknown queue, and a cycle that no pre-filled register
breaks (every actor on it would wait for another forever).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

QUEUES = ("compute", "copy", "network", "data")


@dataclass(frozen=True)
class ActorSpec:
    """One actor.

    ``action(piece, *inputs) -> output`` runs once per piece; ``inputs`` names
    the producers whose outputs it reads, in argument order. ``quota`` is the
    number of out registers (its memory): it acts only when one is free.
    ``initial`` maps some of its producers to a value that is readable before
    that producer ran (the producer's piece ``k`` then feeds piece ``k + 1``):
    this is how a cycle (e.g. parameters updated by the optimizer and read by
    the next step) starts. ``credits`` maps some producers on its own rank to
    a count ``n``: ``n`` registers (of ``None``) are readable before that
    producer ran, so its piece ``k`` feeds piece ``k + n`` — an edge that
    lets this actor run at most ``n`` pieces ahead of the producer (a pipeline
    rank's shallower stage ahead of its deeper one). ``priority``: among ready actors on one thread the
    highest acts first. ``rank``: the process it runs on; an edge between
    ranks becomes a send actor on the producer's rank and a receive actor on
    the consumer's, each on a network queue of its own.

    ``every``: the actor acts once per ``every`` pieces of the run, reading
    ``every // producer.every`` registers from each input per action (a
    list of values when that is more than one): gradient reduction and the
    optimizer update act once per step over ``m`` micro-batch pieces.
    ``role``: the actor's name within a lockstep gang (see ``Plan``);
    defaults to ``name``. ``out``: ``(shape, dtype)`` when every output is a
    contiguous tensor of that shape and dtype; an edge from it to another
    rank then sends the data alone (no header per value), and a value of
    another shape or dtype fails the run. ``pool``: the name of a register
    budget (``Plan.pools``) it shares with other compute actors of its rank:
    each of its registers also holds one of the pool's slots until freed
    (``runtime.actor.Pool``); ``reserve``: it takes a slot only while more
    than ``reserve`` are free.
    """

    name: str
    action: Callable
    inputs: tuple = ()
    queue: str = "compute"
    quota: int = 2
    priority: int = 0
    initial: dict = field(default_factory=dict)
    rank: int = 0
    every: int = 1
    role: str = ""
    out: tuple | None = None
    pool: str = ""
    reserve: int = 0
    credits: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.role or self.name


class PlanError(ValueError):
    """A plan that cannot run, found before it runs."""


@dataclass
class Plan:
    """Actors, and the lockstep gangs among their ranks.

    A gang is a tuple of ranks whose compute queues must act in one order —
    the ranks of a pipeline stage run collectives with each other inside
    their actions, and a collective pairs calls by order. Each rank of a gang
    has compute actors with the same roles; the gang's first rank picks by
    readiness and priority as usual and the others follow its picks.
    """

    actors: list
    lockstep: list = field(default_factory=list)
    pools: dict = field(default_factory=dict)  # pool name -> its slots (ActorSpec.pool)

    def by_name(self) -> dict:
        return {a.name: a for a in self.actors}

    def consumers(self) -> dict:
        out = {a.name: [] for a in self.actors}
        for a in self.actors:
            for k, src in enumerate(a.inputs):
                out[src].append((a.name, k))
        return out

    def validate(self, world_size: int = 1) -> None:
        names = [a.name for a in self.actors]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise PlanError(f"actor names must be unique: {dup} repeat")
        known = set(names)
        for a in self.actors:
            if a.queue not in QUEUES:
                raise PlanError(f"actor {a.name!r}: queue {a.queue!r} is not one of {QUEUES}")
            if not 0 <= a.rank < world_size:
                raise PlanError(f"actor {a.name!r}: rank {a.rank} is not in the world: valid ranks are 0..{world_size - 1}")
            if not isinstance(a.quota, int) or a.quota < 1:
                raise PlanError(f"actor {a.name!r}: quota {a.quota!r} must be an int >= 1 (its out registers)")
            for src in a.inputs:
                if src not in known:
                    raise PlanError(f"actor {a.name!r} reads from {src!r}, which is no actor; actors: {sorted(known)}")
            for src in a.initial:
                if src not in a.inputs:
                    raise PlanError(f"actor {a.name!r}: initial value for {src!r}, which is not one of its inputs {list(a.inputs)}")
            for src, n in a.credits.items():
                if src not in a.inputs or src in a.initial or not isinstance(n, int) or n < 1:
                    raise PlanError(f"actor {a.name!r}: credits {src!r}: {n!r} must name one of its inputs "
                                    f"{list(a.inputs)} (without an initial value) with an int >= 1")
            if not isinstance(a.every, int) or a.every < 1:
                raise PlanError(f"actor {a.name!r}: every={a.every!r} must be an int >= 1")
            if a.out is not None and not (isinstance(a.out, tuple) and len(a.out) == 2
                                          and isinstance(a.out[1], torch.dtype)
                                          and all(isinstance(n, int) and n >= 0 for n in a.out[0])):
                raise PlanError(f"actor {a.name!r}: out={a.out!r} must be (shape of ints >= 0, torch dtype)")
        self._check_pools()
        by = self.by_name()
        for a in self.actors:
            for src in a.inputs:
                if a.every % by[src].every:
                    raise PlanError(f"actor {a.name!r} (every {a.every}) reads {src!r} (every {by[src].every}): "
                                    "a consumer's every must be a multiple of its producers'")
                if (src in a.initial or src in a.credits) and a.every != by[src].every:
                    raise PlanError(f"actor {a.name!r}: an initial register needs the same every as {src!r}")
                if src in a.credits and (by[src].rank != a.rank or by[src].quota < a.credits[src]):
                    raise PlanError(f"actor {a.name!r}: credits from {src!r} need it on the same rank with a quota "
                                    f"of at least {a.credits[src]}")
        prefilled: dict = {}  # producer -> its registers filled before a run, over all its consumers
        for a in self.actors:
            for src in a.inputs:
                prefilled[src] = prefilled.get(src, 0) + (src in a.initial) + a.credits.get(src, 0)
        for src, n in prefilled.items():
            if n > by[src].quota:
                raise PlanError(f"actor {src!r} has quota {by[src].quota}, too few for the {n} registers its "
                                "consumers' initial values and credits fill before a run")
        self._check_gangs(world_size)
        self._check_cycles()

    def _check_pools(self) -> None:
        """A pool has at least one slot and its actors are compute actors of one rank (one thread owns it)."""
        for name, size in self.pools.items():
            if not isinstance(size, int) or size < 1:
                raise PlanError(f"pool {name!r}: size {size!r} must be an int >= 1")
        where = {}
        for a in self.actors:
            if not a.pool:
                continue
            if a.pool not in self.pools:
                raise PlanError(f"actor {a.name!r}: pool {a.pool!r} is not one of the plan's pools {sorted(self.pools)}")
            if a.queue != "compute":
                raise PlanError(f"actor {a.name!r}: only compute actors share a pool, not {a.queue!r} ones")
            if not isinstance(a.reserve, int) or not 0 <= a.reserve < self.pools[a.pool]:
                raise PlanError(f"actor {a.name!r}: reserve {a.reserve!r} must be an int in [0, {self.pools[a.pool]})")
            if where.setdefault(a.pool, a.rank) != a.rank:
                raise PlanError(f"pool {a.pool!r}: its actors must be on one rank; {a.name!r} is on {a.rank}, "
                                f"another on {where[a.pool]}")
            if any(a.name in b.initial for b in self.actors):
                raise PlanError(f"actor {a.name!r}: an actor in a pool cannot have initial registers")

    def _check_gangs(self, world_size: int) -> None:
        seen = set()
        for gang in self.lockstep:
            if len(set(gang)) != len(gang) or not all(0 <= r < world_size for r in gang) or seen & set(gang):
                raise PlanError(f"lockstep gang {gang} must list distinct ranks of the world, in no other gang")
            seen |= set(gang)
            roles = {r: sorted(a.key for a in self.actors if a.rank == r and a.queue == "compute") for r in gang}
            if any(v != roles[gang[0]] for v in roles.values()):
                raise PlanError(f"lockstep gang {gang}: ranks have different compute roles: {roles}")
            for r in gang:
                if len(set(roles[r])) != len(roles[r]):
                    raise PlanError(f"lockstep gang {gang}: rank {r} repeats a compute role: {roles[r]}")

    def _check_cycles(self) -> None:
        """Every cycle of edges must pass an edge with an initial register."""
        blocking = {a.name: [s for s in a.inputs if s not in a.initial and s not in a.credits] for a in self.actors}
        state: dict = {}

        def visit(n, path):
            state[n] = 1
            for src in blocking[n]:
                if state.get(src) == 1:
                    cycle = path[path.index(src):] + [src] if src in path else [n, src]
                    raise PlanError(
                        f"cycle {' <- '.join(cycle)} has no initial register to break it: "
                        "give one of its consumers an initial value for its producer"
                    )
                if state.get(src) is None:
                    visit(src, path + [src])
            state[n] = 2

        for a in self.actors:
            if a.name not in state:
                visit(a.name, [a.name])
