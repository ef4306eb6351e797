"""The search space: which strategies exist for a model on a cluster, and moves between them.

A strategy (``strategy.Strategy``) sets dp, tp and pp (using all of a
cluster's devices; on a machine whose devices are processes sharing a CPU,
any power-of-two count up to them), the ZeRO stage (with dp > 1), the
micro-batch size (a divisor of ``global_batch`` over the batch's shards —
``dp`` for GPT-2 — with at least ``pp`` micro-batches), sequence parallel (with tp > 1), the pipeline schedule and
stages per rank (with pp > 1: ``PIPELINES``) and one candidate per per-op
choice point (``model.choices``: index 0 is the recipe's own layout).
``model.problems(strategy)`` has the last word on validity (e.g. layers
that do not divide into ``pp * virtual`` stages).

``propose(strategy, rng)`` changes one thing, chosen uniformly among the
kinds of change the strategy allows — FlexFlow's proposal: a random op
gets a random new configuration, here widened to the global knobs.
"""
from __future__ import annotations

from dataclasses import replace

from .strategy import Strategy

# (pp_schedule, stages per pipeline rank) the search may pick for a pipeline: 1F1B, interleaved 1F1B (2 or 3
# stages per rank), GPipe, ZB-H1, interleaved zero bubble (2 or 3) and ZB-V.
PIPELINES = (("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("gpipe", 1), ("zb", 1), ("zb", 2), ("zb", 3), ("zbv", 2))


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


class SearchSpace:
    def __init__(self, model, devices: int, all_devices: bool = True, zero_stages=(0, 1, 2, 3),
                 sequence_parallel: bool = True, per_op: bool = True):
        self.model, self.devices = model, devices
        worlds = [devices] if all_devices else [w for w in divisors(devices) if w & (w - 1) == 0]
        self.degrees = [(dp, tp, w // (dp * tp)) for w in worlds for tp in divisors(w) for dp in divisors(w // tp)]
        self.zero_stages = tuple(zero_stages)
        self.sequence_parallel = sequence_parallel and model.recipe.sequence_parallel  # the recipe's variant
        self.choices = list(model.choices) if per_op else []
        self._valid: dict = {}

    def micro_batch_sizes(self, dp: int, tp: int, pp: int) -> list:
        gb, shards = self.model.global_batch, self.model.data_shards(dp, tp)
        if gb % shards:
            return []
        return [mb for mb in divisors(gb // shards) if pp == 1 or gb // (shards * mb) >= pp]

    def valid(self, s: Strategy) -> bool:
        got = self._valid.get(s)
        if got is None:
            got = self._valid[s] = not self.model.problems(s)
        return got

    def layouts(self) -> list:
        """Every valid ``(dp, tp, pp)`` with its valid micro-batch sizes (recipe's per-op layouts, no ZeRO)."""
        out = []
        for dp, tp, pp in self.degrees:
            mbs = [mb for mb in self.micro_batch_sizes(dp, tp, pp) if self.valid(Strategy(dp, tp, pp, micro_batch_size=mb))]
            if mbs:
                out.append(((dp, tp, pp), mbs))
        return out

    def seeds(self, devices_per_node: int) -> list:
        """Data parallel over every device, and Megatron's layout (tp within a node, dp across), largest micro-batch first."""
        out = []
        layouts = dict(self.layouts())
        for want in (lambda dp, tp, pp: tp == 1 and pp == 1,
                     lambda dp, tp, pp: pp == 1 and tp > 1 and tp <= devices_per_node):
            cands = [k for k in layouts if want(*k)]
            if not cands:
                continue
            dp, tp, pp = max(cands, key=lambda k: (k[0] * k[1], k[1]))  # most devices, then widest tp
            for mb in sorted(layouts[(dp, tp, pp)], reverse=True):
                s = Strategy(dp, tp, pp, micro_batch_size=mb)
                if self.valid(s):
                    out.append(s)
                    break
        return out

    def _moves(self, s: Strategy) -> list:
        moves = ["degrees", "micro_batch"]
        if s.pp > 1:
            moves.append("schedule")
        if s.dp > 1 and len(self.zero_stages) > 1:
            moves.append("zero")
        if s.tp > 1 and self.sequence_parallel:
            moves.append("sequence_parallel")
        if s.tp > 1 and self.choices:
            moves.append("op")
        return moves

    def propose(self, s: Strategy, rng) -> Strategy:
        """A random neighbour of ``s`` (possibly invalid: check with ``valid``)."""
        move = rng.choice(self._moves(s))
        if move == "degrees":
            dp, tp, pp = rng.choice([d for d in self.degrees if d != (s.dp, s.tp, s.pp)] or self.degrees)
            mbs = self.micro_batch_sizes(dp, tp, pp) or [1]
            mb = min(mbs, key=lambda x: (abs(x - s.micro_batch_size), x))
            zero = s.zero if dp > 1 else 0
            schedule, virtual = (s.schedule, s.virtual) if pp > 1 else ("1f1b", 1)
            return replace(s, dp=dp, tp=tp, pp=pp, micro_batch_size=mb, zero=zero,
                           sequence_parallel=s.sequence_parallel and tp > 1, schedule=schedule, virtual=virtual)
        if move == "micro_batch":
            mbs = [m for m in self.micro_batch_sizes(s.dp, s.tp, s.pp) if m != s.micro_batch_size]
            return replace(s, micro_batch_size=rng.choice(mbs)) if mbs else s
        if move == "zero":
            return replace(s, zero=rng.choice([z for z in self.zero_stages if z != s.zero]))
        if move == "sequence_parallel":
            return replace(s, sequence_parallel=not s.sequence_parallel)
        if move == "schedule":
            schedule, virtual = rng.choice([p for p in PIPELINES if p != (s.schedule, s.virtual)])
            return replace(s, schedule=schedule, virtual=virtual)
        choice = rng.choice(self.choices)
        return self.model.apply_choice(s, choice, rng.randrange(len(choice.candidates)))
