"""An actor: in registers it reads, out registers it owns, and the state machine between.

Counters decide everything: an actor acts when every input edge holds a
readable register (``req`` arrived) and one of its own out registers is
free (every consumer ``ack``-ed it). Out registers are a fixed pool of
``quota``, so a producer whose consumers lag stops — back pressure — and
never holds more live registers than its quota. Consumers on the same
process read the producer's register object itself (zero copy).
"""
from __future__ import annotations

from collections import deque


class Register:
    """One out register: a value and how many consumers still have to ack it."""

    __slots__ = ("owner", "value", "piece", "pending", "pooled")

    def __init__(self, owner):
        self.owner = owner
        self.value = None
        self.piece = -1
        self.pending = 0
        self.pooled = False  # it holds one of its owner's pool's slots until freed


class Pool:
    """A register budget that several actors of one thread share (``ActorSpec.pool``).

    An actor in a pool acts only when the pool has more free slots than its
    ``reserve`` (``ActorSpec.reserve``: slots it leaves to others), as well
    as a free register of its own; each register it fills holds a slot until
    it is freed. A pipeline rank's stages share their activation memory this
    way: the rank holds at most ``size`` micro-batches' activations,
    whichever of its stages they belong to, and a shallower stage leaves a
    slot to the rank's deepest one, so that stage, whose backwards free the
    slots, can always go on (``runtime.pipeline.schedule.stash_reserve``).
    """

    __slots__ = ("name", "size", "free", "max_live")

    def __init__(self, name: str, size: int):
        self.name, self.size, self.free, self.max_live = name, size, size, 0


class Actor:
    __slots__ = ("aid", "spec", "remaining", "inputs", "need", "free", "consumers", "max_live", "actions", "next_piece",
                 "_single", "pool", "log")

    # An edge read ``need > 1`` registers per action is an accumulating edge
    # (OneFlow's acc actor): each register's value is taken and acked as it
    # arrives, so the producer's quota does not have to cover ``need``.

    def __init__(self, aid: int, spec, pieces: int, need=None, pool: Pool | None = None):
        self.aid = aid
        self.pool = pool
        self.spec = spec
        self.remaining = pieces // spec.every
        self.next_piece = 0
        self.inputs = [deque() for _ in spec.inputs]  # readable registers per input edge, FIFO
        self.need = list(need or [1] * len(spec.inputs))  # registers read per action, per input edge
        self._single = all(n == 1 for n in self.need)  # one register per edge: act's short path
        self.free = [Register(self) for _ in range(spec.quota)]
        self.consumers: list = []  # (consumer actor, input edge index)
        self.max_live = 0
        self.actions = 0
        self.log = None  # a list to record each action in (``runtime.replay``), or None

    @property
    def live(self) -> int:
        return self.spec.quota - len(self.free)

    def ready(self) -> bool:
        if self.remaining <= 0 or not self.free:
            return False
        if self.pool is not None and self.pool.free <= self.spec.reserve:
            return False
        for q, n in zip(self.inputs, self.need):  # a loop, not all(<generator>): called per pick per actor
            if len(q) < n:
                return False
        return True

    def act(self, send):
        """Run one piece: read one register per input, fill a free out register, send req and ack.

        ``send(kind, register, actor, edge)`` delivers a message to ``actor``.
        """
        piece = self.next_piece
        if self._single:
            read = [q.popleft() for q in self.inputs]
            values = [r.value for r in read]
            if self.log is not None:
                self.log.append((self.aid, piece, tuple((r.owner.aid, r.piece) for r in read)))
        else:
            taken = [[q.popleft() for _ in range(n)] for q, n in zip(self.inputs, self.need)]
            read = [rs[0] for rs, n in zip(taken, self.need) if n == 1]  # accumulating edges were acked on arrival
            values = [rs[0].value if n == 1 else [v for v, _ in rs] for rs, n in zip(taken, self.need)]
            if self.log is not None:
                self.log.append((self.aid, piece, tuple((rs[0].owner.aid, rs[0].piece) if n == 1
                                                        else [key for _, key in rs] for rs, n in zip(taken, self.need))))
        free = self.free
        reg = free.pop()
        pool = self.pool
        if pool is not None:
            pool.free -= 1
            reg.pooled = True
            if pool.size - pool.free > pool.max_live:
                pool.max_live = pool.size - pool.free
        out = reg.value = self.spec.action(piece, *values)
        reg.piece = piece
        reg.pending = len(self.consumers)
        live = self.spec.quota - len(free)
        if live > self.max_live:
            self.max_live = live
        self.remaining -= 1
        self.next_piece += 1
        self.actions += 1
        if not self.consumers:
            self.release(reg)
        for consumer, edge in self.consumers:
            send("req", reg, consumer, edge)
        for r in read:
            send("ack", r, r.owner, None)
        return out

    def on_req(self, reg, edge: int) -> bool:
        """Queue a readable register; ``True`` when it was taken at once and must be acked now."""
        if self.need[edge] > 1:  # the value now (the register is acked at once) and where it came from
            self.inputs[edge].append((reg.value, (reg.owner.aid, reg.piece)))
            return True
        self.inputs[edge].append(reg)
        return False

    def on_ack(self, reg) -> None:
        reg.pending -= 1
        if reg.pending == 0:
            self.release(reg)

    def release(self, reg) -> None:
        reg.value = None
        if reg.pooled:
            reg.pooled = False
            self.pool.free += 1
        self.free.append(reg)
