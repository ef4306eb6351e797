"""The execution simulator on tiny task graphs whose timelines are computed by hand."""
from __future__ import annotations

import random

import pytest

from toolkit.search.simulator import SimActor, TaskGraph, resimulate, simulate
from toolkit.search.taskgraph import StageWork, pipeline_graph, stage_actor_names


def _times(tl, prefix):
    return [(a, k, s, e) for a, k, s, e in tl.tasks if a.startswith(prefix)]


def test_two_stage_1f1b_by_hand():
    # F = 1, B = 2 on both stages, transfers free; stage 0 holds 2 stashes, stage 1 one.
    w = StageWork(forward=1, backward_first=2, backward=2, reduce=0.5, update=0.25)
    tl = simulate(pipeline_graph([w, w], micro_batches=3))
    s0 = [(a, k, s, e) for a, k, s, e in _times(tl, "s0.") if a in ("s0.F", "s0.B", "s0.reduce", "s0.update")]
    s1 = [(a, k, s, e) for a, k, s, e in _times(tl, "s1.") if a in ("s1.F", "s1.B", "s1.reduce", "s1.update")]
    assert s0 == [("s0.F", 0, 0, 1), ("s0.F", 1, 1, 2), ("s0.B", 0, 4, 6), ("s0.F", 2, 6, 7), ("s0.B", 1, 7, 9),
                  ("s0.B", 2, 10, 12), ("s0.reduce", 0, 12, 12.5), ("s0.update", 0, 12.5, 12.75)]
    assert s1 == [("s1.F", 0, 1, 2), ("s1.B", 0, 2, 4), ("s1.F", 1, 4, 5), ("s1.B", 1, 5, 7), ("s1.F", 2, 7, 8),
                  ("s1.B", 2, 8, 10), ("s1.reduce", 0, 10, 10.5), ("s1.update", 0, 10.5, 10.75)]
    assert tl.makespan == 12.75


def test_gpipe_quota_and_tied_exchange():
    # GPipe: every stash free, so stage 0 runs its three forwards back to back; tied grads wait for both reductions.
    w = StageWork(forward=1, backward_first=2, backward=2, reduce=0.5, update=0.25)
    tl = simulate(pipeline_graph([w, w], micro_batches=3, schedule="gpipe", tied=0.1))
    f0 = [(s, e) for a, k, s, e in tl.tasks if a == "s0.F"]
    assert f0 == [(0, 1), (1, 2), (2, 3)]
    tied = [(s, e) for a, k, s, e in tl.tasks if a == "tied"]
    reduces = {a: e for a, k, s, e in tl.tasks if a.endswith(".reduce")}
    assert tied[0][0] == max(reduces.values())
    ups = [(a, s) for a, k, s, e in tl.tasks if a.endswith(".update")]
    assert all(s == pytest.approx(tied[0][1]) for _, s in ups)


def test_transfers_delay_the_next_stage():
    w = StageWork(forward=1, backward_first=1, backward=1, reduce=0, update=0, send=0.5, copy=0.25)
    tl = simulate(pipeline_graph([w, w], micro_batches=2))
    first_f1 = min(s for a, k, s, e in tl.tasks if a == "s1.F")
    assert first_f1 == 1 + 0.25 + 0.5 + 0.25  # forward, cut, send, assemble


def test_processor_sharing():
    # One core, two busy threads: each runs at half speed until the shorter task ends.
    g = TaskGraph([SimActor("a", "q1", 1.0, weight=1), SimActor("b", "q2", 2.0, weight=1)], pieces=1,
                  rate=lambda n: min(1.0, 1.0 / n))
    tl = simulate(g)
    assert {a: (s, e) for a, _, s, e in tl.tasks} == {"a": (0, 2.0), "b": (0, 3.0)}


def test_priority_and_quota():
    # x (quota 1) feeds y; y has priority over x on the same queue, so they alternate.
    g = TaskGraph([SimActor("x", "q", 1.0, quota=1), SimActor("y", "q", 1.0, inputs=("x",), priority=1)], pieces=3)
    order = [(a, k) for a, k, *_ in simulate(g).tasks]
    assert order == [("x", 0), ("y", 0), ("x", 1), ("y", 1), ("x", 2), ("y", 2)]


def test_deadlock_is_reported():
    g = TaskGraph([SimActor("x", "q", 1.0, inputs=("y",)), SimActor("y", "q", 1.0, inputs=("x",))], pieces=1)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(g)


@pytest.mark.parametrize("pp,m,sched", [(2, 4, "1f1b"), (3, 6, "1f1b"), (4, 4, "gpipe")])
def test_delta_equals_full(pp, m, sched):
    rng = random.Random(pp * 10 + m)

    def stage():
        return StageWork(*(round(rng.uniform(0.1, 2), 3) for _ in range(5)), send=0.05, copy=0.01, weight=1)

    stages = [stage() for _ in range(pp)]
    rate = (lambda n: min(1.0, 2.0 / n))
    old = simulate(pipeline_graph(stages, m, sched, tied=0.2, clip=True, rate=rate))
    for _ in range(5):
        s = rng.randrange(pp)
        stages = list(stages)
        stages[s] = stage()
        graph = pipeline_graph(stages, m, sched, tied=0.2, clip=True, rate=rate)
        new = resimulate(old, graph, stage_actor_names(s, pp))
        full = simulate(graph)
        assert new.tasks == full.tasks and new.makespan == full.makespan
        old = new
