"""Metropolis-Hastings over a tiny made-up space whose costs are known."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from toolkit.search.mcmc import search
from toolkit.search.strategy import Strategy

COST = {(1, 4): 4.0, (2, 2): 2.5, (4, 1): 3.0}  # (dp, tp) -> step seconds; micro-batch 1 is 0.5 s faster


@dataclass
class Pred:
    strategy: Strategy
    step_seconds: float
    fits: bool = True


class Space:
    def seeds(self, devices_per_node):
        return [Strategy(4, 1, 1, micro_batch_size=2), Strategy(1, 4, 1, micro_batch_size=2)]

    def propose(self, s, rng):
        if rng.random() < 0.5:
            dp = rng.choice([1, 2, 4])
            return replace(s, dp=dp, tp=4 // dp)
        return replace(s, micro_batch_size=rng.choice([1, 2, 3]))

    def valid(self, s):
        return s.micro_batch_size != 3


class Evaluator:
    calls = 0

    def predict(self, s, base=None):
        Evaluator.calls += 1
        return Pred(s, COST[(s.dp, s.tp)] - (0.5 if s.micro_batch_size == 1 else 0.0))


def test_finds_the_optimum_from_the_seeds():
    res = search(Space(), Evaluator(), budget=80, beta=5.0, seed=3, progress=False)
    assert [p.strategy.dp for p in res.seeds] == [4, 1]
    assert (res.best.strategy.dp, res.best.strategy.tp, res.best.strategy.micro_batch_size) == (2, 2, 1)
    assert res.best.step_seconds == 2.0
    assert res.invalid > 0 and res.accepted > 0
    assert res.evaluated <= 6  # each distinct strategy is predicted once


def test_a_strategy_from_a_layout_name_and_cp_refused():
    s = Strategy.from_name("tp2_dp4_zero1", 2)
    assert (s.dp, s.tp, s.pp, s.zero, s.micro_batch_size) == (4, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="the simulator lays out dp, tp and pp only, not cp=2"):
        Strategy.from_name("dp2_cp2")
