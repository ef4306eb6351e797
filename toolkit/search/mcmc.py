"""Metropolis-Hastings search over strategies (FlexFlow's MCMC), priced by the execution simulator.

Start from the best of the seeds (data parallel, Megatron's layout); each
iteration proposes a neighbour (``space.propose``), predicts it
(``evaluate.Evaluator``; a proposal that only changes per-op layouts is
priced by delta simulation from the current one) and accepts it with
probability ``min(1, exp(-beta * (new - current) / current))`` — a
relative cost, so ``beta`` does not depend on the model's scale. Invalid
proposals and ones that do not fit in memory are rejected. ``budget`` is
the number of proposals; the best strategy seen is returned with its
prediction and the search's history.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class SearchResult:
    best: object  # Prediction
    seeds: list  # Prediction of each seed
    accepted: int = 0
    rejected: int = 0
    invalid: int = 0
    evaluated: int = 0
    history: list = field(default_factory=list)  # (iteration, strategy name, predicted seconds, accepted)


def _cost(pred) -> float:
    return pred.step_seconds if pred.fits else math.inf


def search(space, evaluator, budget: int = 200, beta: float = 20.0, seed: int = 0, devices_per_node: int = 8,
           progress: bool = True) -> SearchResult:
    rng = random.Random(seed)
    seeds = [evaluator.predict(s) for s in space.seeds(devices_per_node)]
    if not seeds:
        raise ValueError("no valid seed strategy (data parallel or Megatron) for this model and cluster")
    current = min(seeds, key=_cost)
    best = current
    res = SearchResult(best, seeds)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=budget, desc="search", unit="plan", dynamic_ncols=True, leave=False)
    seen: dict = {}
    try:
        for it in range(budget):
            cand = space.propose(current.strategy, rng)
            if cand == current.strategy or not space.valid(cand):
                res.invalid += 1
            else:
                pred = seen.get(cand)
                if pred is None:
                    try:
                        pred = evaluator.predict(cand, base=current)
                    except (ValueError, RuntimeError, NotImplementedError):  # the dispatcher refused a layout
                        pred = None
                    seen[cand] = pred
                    res.evaluated += 1
                if pred is None or not math.isfinite(_cost(pred)):
                    res.invalid += 1
                else:
                    delta = (_cost(pred) - _cost(current)) / _cost(current)
                    take = delta <= 0 or rng.random() < math.exp(-beta * delta)
                    res.history.append((it, cand.describe(), pred.step_seconds, take))
                    if take:
                        current = pred
                        res.accepted += 1
                        if _cost(pred) < _cost(best):
                            best = pred
                    else:
                        res.rejected += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(best=f"{best.strategy.name} {best.step_seconds:.3g}s")
    finally:
        if bar is not None:
            bar.close()
    res.best = best
    return res
