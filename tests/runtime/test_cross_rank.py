"""Actors on different ranks: the consumer's receive actor pulls, within its quota."""
from __future__ import annotations

import json
from dataclasses import replace

import torch

from runtime.executor import RuntimeFailure, run
from runtime.plan import ActorSpec, Plan
from runtime.trace import Trace
from toolkit.rank_pool import get_pool


def _square(k, x):
    return x * x


def _plan():
    return Plan([
        ActorSpec("load", lambda k: torch.full((3,), float(k)), queue="data", rank=0, out=((3,), torch.float32)),
        ActorSpec("square", _square, inputs=("load",), rank=1),
        ActorSpec("cube", lambda k, x, y: x * y, inputs=("square", "load"), rank=2),
        ActorSpec("log", lambda k, x: {"piece": k, "value": x.sum().item()}, inputs=("cube",), rank=0),
    ])


def _round_trip(pieces):
    trace = Trace(rank=torch.distributed.get_rank())
    res = run(_plan(), pieces, timeout=30, trace=trace)
    return res.outputs, {n: (s.actions, s.max_live, s.quota) for n, s in res.stats.items()}, trace.chrome_events()


def test_three_ranks_pass_tensors_and_objects_in_order():
    out = get_pool(5).run(_round_trip, 12)
    outputs, stats, events = out[0]
    assert [o["value"] for o in outputs["log"]] == [3.0 * k ** 3 for k in range(12)]
    for rank in range(3):
        for name, (actions, live, quota) in out[rank][1].items():
            assert actions == 12 and live <= quota, (rank, name)
    assert "recv:square" in out[2][1] and "send:load->1" in out[0][1] and "send:load->2" in out[0][1]
    # Every rank traced its own threads, each network channel on a thread of its own.
    names = {e["args"]["name"] for e in out[2][2] if e["name"] == "thread_name"}
    assert names == {"compute", "network:1", "network:2", "network:3"}


def test_a_three_rank_trace_is_chrome_json_with_a_track_per_rank_and_thread(tmp_path):
    from scripts.plot_trace import load_trace, render, validate

    out = get_pool(5).run(_round_trip, 4)
    events = [e for rank in range(3) for e in out[rank][2]]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    validate(load_trace(str(path)))
    drawn = render(str(path), str(tmp_path / "trace.png"))
    # rank 0: data, compute, 3 channels; rank 1: compute, 2 channels; rank 2: compute, 3 channels.
    assert len(drawn["tracks"]) == 12 and drawn["events"] == sum(e["ph"] == "X" for e in events)


def _failing(timeout):
    from sbp_core import process_groups

    def boom(k, x):
        if k == 2:
            raise ValueError("bad piece")
        return x

    process_groups.set_timeout(timeout)
    plan = Plan([
        ActorSpec("load", lambda k: torch.ones(2), rank=0),
        ActorSpec("step", boom, inputs=("load",), rank=1),
        ActorSpec("log", lambda k, x: x, inputs=("step",), rank=0),
    ])
    run(plan, 6, timeout=30)


def test_an_error_on_one_rank_ends_every_rank():
    pool = get_pool(2, timeout=3.0)
    outs = pool.outcomes(_failing, 3.0)
    assert not outs[1].ok and "actor 'step' failed on piece 2: ValueError: bad piece" in outs[1].message
    assert not outs[0].ok and outs[0].exc_type == "RuntimeFailure"


def _sends_per_value(shape, declared):
    """Transfers of one 2-rank channel over 4 pieces: ``(dist.isend calls on rank 0, values received on rank 1)``;
    not counting the one element that opens the channel before the plan's first run (``executor._open``)."""
    from unittest import mock

    import torch.distributed as dist

    real, calls = dist.isend, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    plan = Plan([
        ActorSpec("load", lambda k: torch.full(shape, float(k)), rank=0,
                  out=None if declared is None else (declared, torch.float32)),
        ActorSpec("sum", lambda k, x: float(x.sum()), inputs=("load",), rank=1),
    ])
    from runtime.executor import _prepared

    _prepared(plan, dist.get_rank(), dist.get_world_size())  # opens the channel: counted out
    with mock.patch.object(dist, "isend", counting):
        res = run(plan, 4, timeout=30)
    return len(calls), res.outputs.get("sum")


def test_a_channel_from_an_actor_declaring_its_out_sends_the_data_alone():
    pool = get_pool(2, timeout=3.0)
    sends, got = zip(*pool.run(_sends_per_value, (2, 3), (2, 3)))
    assert sends[0] == 4 and got[1] == [6.0 * k for k in range(4)]  # one transfer per value, no header
    untyped = pool.run(_sends_per_value, (2, 3), None)
    assert untyped[0][0] == 8 and untyped[1][1] == [6.0 * k for k in range(4)]  # header, then data
    outs = pool.outcomes(_sends_per_value, (2, 3), (3, 2))
    assert not outs[0].ok and "actor 'load' declares out (3, 2) torch.float32 but produced (2, 3) torch.float32" \
        in outs[0].message
    assert not outs[1].ok and outs[1].exc_type == "RuntimeFailure"


def _opened_then_acted():
    """``_plan()``'s run on this rank: the events in order, each channel's opening (``executor._open``: peer,
    sending) and each action (its actor's name)."""
    from unittest import mock

    from runtime import executor

    events, real = [], executor.collectives.open_p2p

    def opening(peer, group, send):
        events.append(("open", peer, send))
        return real(peer, group, send)

    def logged(spec):
        def act(k, *xs):
            events.append(("act", spec.name))
            return spec.action(k, *xs)

        return replace(spec, action=act)

    plan = Plan([logged(s) for s in _plan().actors])
    with mock.patch.object(executor.collectives, "open_p2p", opening):
        run(plan, 2, timeout=30)
    return events


def test_every_channel_is_opened_in_one_order_before_any_actor_acts():
    """Before a plan's first run each rank sends or receives one element on each of its channels, in the plan's
    channel order (``load`` 0->1, ``square`` 1->2, ``load`` 0->2, ``cube`` 2->0), so that under NCCL no
    channel's communicator is built in the middle of a run."""
    out = get_pool(5).run(_opened_then_acted)
    want = {0: [(1, True), (2, True), (2, False)], 1: [(0, False), (2, True)], 2: [(1, False), (0, False), (0, True)]}
    for rank, events in enumerate(out[:3]):
        opened = [e[1:] for e in events if e[0] == "open"]
        assert opened == want[rank], (rank, events)
        assert all(e[0] == "open" for e in events[:len(opened)]), (rank, events)  # before any action
        assert any(e[0] == "act" for e in events), (rank, events)
    assert out[3] == out[4] == []  # ranks outside the plan open nothing


def _echo_with_a_slow_reader(pieces):
    """A value goes 0 -> 1 and back; on rank 1 a copy actor (one register) reads the receive and feeds a fast
    compute actor, whose output rank 0's next piece needs, and a slow one, which frees the register late."""
    import time

    plan = Plan([
        ActorSpec("ping", lambda k, x: x + 1, inputs=("pong",), initial={"pong": torch.zeros(3)}, rank=0,
                  out=((3,), torch.float32)),
        ActorSpec("copy", lambda k, x: x.clone(), inputs=("ping",), queue="copy", quota=1, rank=1),
        ActorSpec("pong", lambda k, x: x * 1, inputs=("copy",), priority=1, rank=1, out=((3,), torch.float32)),
        ActorSpec("slow", lambda k, x: time.sleep(0.3) or float(x[0]), inputs=("copy",), rank=1),
    ])
    return run(plan, pieces, timeout=5).outputs.get("slow")


def test_an_actor_after_a_receive_is_not_held_up_by_the_next_receive():
    """On a host without an accelerator the copy actor may not share the receive's thread: there the receive
    of piece 2 (posted once piece 1 arrived) blocks until ``pong`` of piece 1 reaches rank 0, while the copy
    of piece 1 waits for ``slow``'s release of its register, a message behind that receive: a deadlock."""
    got = get_pool(2, timeout=10.0).run(_echo_with_a_slow_reader, 4)
    assert got[1] == [1.0, 2.0, 3.0, 4.0]
