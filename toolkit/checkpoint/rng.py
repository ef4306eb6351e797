"""Random-number generator states as checkpointable values (one per rank: ``save``'s ``per_rank``).

``rng_state()`` gives torch's CPU generator (a ``uint8`` tensor), the CUDA
generator of this rank's device where the job uses CUDA
(``torch.cuda.current_device()``: one GPU per rank, so a job resumed on
another machine or node count restores each rank's own), Python's
``random`` and numpy's global generator as tensors and plain data;
``set_rng_state`` restores them, and ``agree_within`` puts one placement's
ranks back in step after a resume in another layout.
"""
from __future__ import annotations

import random

import torch

from sbp_core.boxing.collectives import all_gather_object


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # a job that uses CUDA (a CPU job on a GPU host opens no context for it)
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}
    return state


def agree_within(ranks) -> bool:
    """Give every rank of ``ranks`` (this rank among them) the torch generators' states of the lowest of them
    where they differ; returns whether they did. Collective over ``ranks`` (a host message).

    A dispatched random op (dropout on a global tensor) draws the global
    draw on every rank of its placement from torch's generators, so they
    must be in step there. Restored per rank from a checkpoint saved in
    another layout, they need not be: the ranks of one new placement may
    hold the states of different old stages.
    """
    ranks = sorted(ranks)
    if len(ranks) < 2:
        return False
    mine = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    states = all_gather_object(mine, ranks)
    if all(_same(states[0], s) for s in states[1:]):
        return False
    torch.set_rng_state(states[0]["torch"])
    if states[0].get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states[0]["cuda"], torch.cuda.current_device())
    return True


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["name"], np.asarray(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
