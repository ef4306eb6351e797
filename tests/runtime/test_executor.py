"""The actor runtime on one process: completion, quotas, ordering, errors, plan checks."""
from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.executor import RuntimeFailure, run, thread_homes
from runtime.ids import actor_id, index_of, rank_of, thread_of
from runtime.plan import QUEUES, ActorSpec, Plan, PlanError
from runtime.trace import Trace
from toolkit.rank_pool import get_pool


def _recorder(name, delay):
    def action(piece, *inputs):
        if delay:
            time.sleep(delay)
        return (name, piece, tuple(x[1] for x in inputs))

    return action


@st.composite
def dag_plans(draw):
    n = draw(st.integers(2, 7))
    specs = []
    for i in range(n):
        srcs = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        specs.append(ActorSpec(
            f"a{i}", _recorder(f"a{i}", draw(st.sampled_from([0, 0, 0.0005, 0.002]))),
            inputs=tuple(f"a{j}" for j in srcs),
            queue=draw(st.sampled_from(QUEUES)),
            quota=draw(st.integers(1, 3)),
            priority=draw(st.integers(0, 2)),
        ))
    return Plan(specs), draw(st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(dag_plans(), st.booleans())
def test_random_dags_complete_within_quota_in_order(case, host_only):
    """On a host-only process (data and copy actors on the compute thread) and with a thread per queue."""
    plan, pieces = case
    with mock.patch("runtime.executor.host_only", return_value=host_only):
        res = run(plan, pieces, timeout=20)
    for spec in plan.actors:
        s = res.stats[spec.name]
        assert s.actions == pieces
        assert s.max_live <= spec.quota
    for name, outs in res.outputs.items():
        # Every consumer read its producers' outputs of the same piece (FIFO registers).
        assert [o[1] for o in outs] == list(range(pieces))
        for o in outs:
            assert all(p == o[1] for p in o[2])


def test_two_movers_two_computations_one_fits():
    """OneFlow paper, Figure 2: memory for one computation's output at a time still completes."""
    plan = Plan([
        ActorSpec("mover_a", lambda k: k, queue="copy", quota=1),
        ActorSpec("mover_b", lambda k: -k, queue="copy", quota=1),
        ActorSpec("comp_a", lambda k, x: x * 2, inputs=("mover_a",), quota=1),
        ActorSpec("comp_b", lambda k, x: x * 3, inputs=("mover_b",), quota=1),
        ActorSpec("join", lambda k, a, b: a + b, inputs=("comp_a", "comp_b"), quota=1),
    ])
    res = run(plan, 20, timeout=10)
    assert res.outputs["join"] == [-k for k in range(20)]
    assert all(s.max_live <= 1 for s in res.stats.values())


def test_back_pressure_stops_a_fast_producer():
    seen = []

    def slow(k, x):
        time.sleep(0.002)
        seen.append(k)
        return x

    plan = Plan([ActorSpec("fast", lambda k: k, queue="data", quota=2), ActorSpec("slow", slow, inputs=("fast",))])
    res = run(plan, 30)
    assert res.stats["fast"].max_live == 2 and res.outputs["slow"] == list(range(30))


def test_a_cycle_starts_from_an_initial_register():
    plan = Plan([
        ActorSpec("grad", lambda k, w: k, inputs=("update",), initial={"update": 0.0}),
        ActorSpec("update", lambda k, g: g, inputs=("grad",), quota=1),
        ActorSpec("log", lambda k, w: w, inputs=("update",)),
    ])
    assert run(plan, 5).outputs["log"] == [0, 1, 2, 3, 4]


def test_priority_prefers_the_higher_actor():
    order = []
    plan = Plan([
        ActorSpec("src", lambda k: k, quota=4),
        ActorSpec("low", lambda k, x: order.append("low"), inputs=("src",), priority=0),
        ActorSpec("high", lambda k, x: order.append("high"), inputs=("src",), priority=1),
    ])
    run(plan, 3)
    assert order.index("high") < order.index("low")


def test_a_pool_bounds_the_registers_its_actors_hold_together():
    """Two producers of 3 registers each share a pool of 2; the first leaves one slot to the second (reserve)."""
    held, order = [0], []

    def make(name):
        def produce(k):
            held[0] += 1
            order.append((name, held[0]))
            return k
        return produce

    def consume(k, x):
        held[0] -= 1

    plan = Plan([ActorSpec("a", make("a"), quota=3, pool="p", reserve=1),
                 ActorSpec("b", make("b"), quota=3, pool="p", priority=-1),
                 ActorSpec("use_a", consume, inputs=("a",), priority=-2),
                 ActorSpec("use_b", consume, inputs=("b",), priority=-2)], pools={"p": 2})
    res = run(plan, 4)
    assert max(n for _, n in order) <= 2 and res.stats["p"].max_live == 2
    assert all(n <= 1 for name, n in order if name == "a")  # a never takes the slot it leaves to b


def test_credits_let_a_consumer_run_n_pieces_ahead_of_its_producer():
    """``b`` reads ``a`` with 2 credits: its piece k needs a's piece k - 2; b outranks a, so it runs ahead by 2."""
    order = []
    plan = Plan([ActorSpec("a", lambda k: order.append(f"a{k}"), quota=2),
                 ActorSpec("b", lambda k, tok: order.append(f"b{k}"), inputs=("a",), credits={"a": 2}, priority=1)])
    run(plan, 4)
    assert order == ["b0", "b1", "a0", "b2", "a1", "b3", "a2", "a3"]


def test_an_exception_stops_everything_and_names_the_actor():
    def boom(k, x):
        if k == 3:
            raise ValueError("bad batch")
        return x

    plan = Plan([ActorSpec("load", lambda k: k, queue="data"), ActorSpec("step", boom, inputs=("load",))])
    with pytest.raises(RuntimeFailure, match=r"actor 'step' failed on piece 3: ValueError: bad batch"):
        run(plan, 10)


@pytest.mark.parametrize("actors,words", [
    ([ActorSpec("a", lambda k, x: x, inputs=("ghost",))], "reads from 'ghost', which is no actor"),
    ([ActorSpec("a", lambda k: k, quota=0)], "quota 0 must be an int >= 1"),
    ([ActorSpec("a", lambda k, x: x, inputs=("b",)), ActorSpec("b", lambda k, x: x, inputs=("a",))],
     "has no initial register to break it"),
    ([ActorSpec("a", lambda k: k, queue="gpu")], "queue 'gpu' is not one of"),
    ([ActorSpec("a", lambda k: k, out=((2, 3), "float32"))], r"out=\(\(2, 3\), 'float32'\) must be \(shape"),
    ([ActorSpec("a", lambda k: k, pool="p")], r"pool 'p' is not one of the plan's pools \[\]"),
    ([ActorSpec("a", lambda k: k, quota=1), ActorSpec("b", lambda k, x: x, inputs=("a",), credits={"a": 2})],
     "credits from 'a' need it on the same rank with a quota of at least 2"),
    ([ActorSpec("a", lambda k: k, quota=1), ActorSpec("b", lambda k, x: x, inputs=("a",), credits={"a": 1}),
      ActorSpec("c", lambda k, x: x, inputs=("a",), credits={"a": 1})],
     "actor 'a' has quota 1, too few for the 2 registers its consumers' initial values and credits fill"),
])
def test_bad_plans_are_refused_before_running(actors, words):
    with pytest.raises(PlanError, match=words):
        run(Plan(actors), 1)


def test_actor_ids_encode_rank_thread_index():
    aid = actor_id(3, 2, 12345)
    assert (rank_of(aid), thread_of(aid), index_of(aid)) == (3, 2, 12345)
    assert aid < 1 << 64


@pytest.mark.parametrize("host_only, threads", [(True, {"compute+data"}), (False, {"compute", "data"})])
def test_trace_has_one_event_per_action_and_named_threads(host_only, threads):
    """A host-only process runs the data actor on the compute thread, and the trace names that thread so."""
    import threading

    ran_on = {}

    def on(name):
        return lambda k, *x: ran_on.setdefault(name, threading.current_thread())

    trace = Trace(rank=0)
    plan = Plan([ActorSpec("load", on("load"), queue="data"), ActorSpec("step", on("step"), inputs=("load",))])
    with mock.patch("runtime.executor.host_only", return_value=host_only):
        run(plan, 4, trace=trace)
    events = trace.chrome_events()
    assert sum(e["ph"] == "X" for e in events) == 8
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == threads
    assert (ran_on["load"] is ran_on["step"]) == host_only


def test_host_only_moves_data_and_copy_actors_that_touch_no_other_rank_onto_compute():
    """``thread_homes``: a chain that reaches a network actor stays off compute (a compute action may block
    in a collective that the other rank reaches only through that transfer); a copy actor between compute
    and one channel's send runs on that channel's thread if the send is its only reader and it holds one
    register (two would overlap), one after its receive does not (the receive of the next piece would hold
    it up); a gang keeps its compute thread to itself."""
    specs = [
        ActorSpec("read", None, queue="data"), ActorSpec("decode", None, inputs=("read",), queue="data"),
        ActorSpec("step", None, inputs=("decode", "relay2", "assemble", "assemble4")),
        ActorSpec("cut", None, inputs=("step",), queue="copy", quota=1),
        ActorSpec("send", None, inputs=("cut",), queue="network:0"),
        ActorSpec("cut2", None, inputs=("step",), queue="copy"), ActorSpec("send5", None, inputs=("cut2",), queue="network:5"),
        ActorSpec("recv", None, queue="network:1"), ActorSpec("relay", None, inputs=("recv",), queue="data"),
        ActorSpec("relay2", None, inputs=("relay",), queue="data"),
        ActorSpec("recv2", None, queue="network:2"), ActorSpec("recv3", None, queue="network:3"),
        ActorSpec("assemble", None, inputs=("recv2", "recv3"), queue="copy"),
        ActorSpec("recv4", None, queue="network:4"), ActorSpec("assemble4", None, inputs=("recv4",), queue="copy"),
    ]
    own = {s.name: s.queue for s in specs}
    with mock.patch("runtime.executor.host_only", return_value=True):
        assert thread_homes(specs, ganged=False) == {**own, "read": "compute", "decode": "compute", "cut": "network:0"}
        assert thread_homes(specs, ganged=True) == {**own, "cut": "network:0"}
    with mock.patch("runtime.executor.host_only", return_value=False):
        assert thread_homes(specs, ganged=False) == own


def test_queue_threads_outlive_a_run_and_start_each_run_with_autograd_on():
    """Runs reuse one long-lived OS thread per queue (``runtime.workers``) that does not leak grad mode; a
    run on one thread runs on the caller's, with autograd on inside and the caller's grad mode after."""
    import threading

    import torch

    seen = []

    def act(k, *x):
        seen.append((threading.current_thread(), torch.is_grad_enabled()))
        torch.set_grad_enabled(False)  # left off on purpose: the next run must not inherit it
        return k

    two = Plan([ActorSpec("load", act, queue="data", quota=1), ActorSpec("a", act, inputs=("load",), quota=1)])
    with mock.patch("runtime.executor.host_only", return_value=False):  # a thread per queue: two threads
        run(two, 1)
        run(two, 1)
    assert seen[1][0] is seen[3][0] and seen[1][0] is not threading.current_thread()
    assert all(on for _, on in seen)
    seen.clear()
    one = Plan([ActorSpec("a", act, queue="compute", quota=1)])
    with torch.no_grad():
        run(one, 1)
        run(one, 1)
        assert not torch.is_grad_enabled()
    assert seen == [(threading.current_thread(), True)] * 2


def test_queue_threads_take_the_callers_cuda_device():
    """The CUDA device is per thread and a new thread's is GPU 0: once CUDA is in use, each job of a queue
    thread runs on the device current where the run was started (rank 3's step on GPU 3)."""
    import torch

    set_to = []
    plan = Plan([ActorSpec("load", lambda k: k, queue="data", quota=1),
                 ActorSpec("a", lambda k, x: x, inputs=("load",), quota=1)])
    with mock.patch("runtime.executor.host_only", return_value=False), \
            mock.patch.object(torch.cuda, "is_initialized", return_value=True), \
            mock.patch.object(torch.cuda, "current_device", return_value=3), \
            mock.patch.object(torch.cuda, "set_device", side_effect=set_to.append):
        run(plan, 1)
    assert set_to == [3, 3]  # the data thread's job and the compute thread's
    set_to.clear()
    with mock.patch("runtime.executor.host_only", return_value=False), \
            mock.patch.object(torch.cuda, "set_device", side_effect=set_to.append):
        run(plan, 1)
    assert set_to == []  # CUDA not in use (or absent): no device is set


def test_a_run_on_one_thread_that_cannot_go_on_fails_at_once_naming_what_waits():
    """The caller's thread is the run's only one: with no actor ready and no message, nothing else ever
    could make one ready, so the run fails then rather than after its timeout. (A valid plan on one thread
    never gets there; actors that never report ready stand in for a bug in the state machine.)"""
    from runtime.actor import Actor

    plan = Plan([ActorSpec("load", lambda k: k, queue="data"), ActorSpec("step", lambda k, x: x, inputs=("load",))])
    t = time.perf_counter()
    with mock.patch("runtime.executor.host_only", return_value=True), \
            mock.patch.object(Actor, "ready", return_value=False), \
            pytest.raises(RuntimeFailure, match=r"no actor can act.*load \(piece 0\) needs its thread"):
        run(plan, 2, timeout=30)
    assert time.perf_counter() - t < 5


def test_a_gloo_job_is_host_only_on_a_machine_with_gpus_too():
    """The job's backend decides, not the machine: the CPU suite on a GPU machine keeps its CPU thread layout
    and receives onto the host."""
    from runtime import executor

    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.get_backend", return_value="gloo"):
        assert executor.host_only()
    with mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.get_backend", return_value="nccl"), \
            mock.patch("torch.cuda.current_device", return_value=0):
        assert not executor.host_only()


def test_pieces_not_a_multiple_of_every_are_refused():
    plan = Plan([ActorSpec("a", lambda k: k), ActorSpec("b", lambda k, xs: xs, inputs=("a",), every=2)])
    with pytest.raises(PlanError, match="not a multiple of every"):
        run(plan, 3, timeout=5)


def _send_transposed():
    plan = Plan([
        ActorSpec("load", lambda k: torch.full((3, 2), float(k)).t(), rank=0, out=((2, 3), torch.float32)),
        ActorSpec("sum", lambda k, x: float(x.sum()), inputs=("load",), rank=1),
    ])
    return run(plan, 2, timeout=30).outputs.get("sum")


def test_a_declared_channel_refuses_a_non_contiguous_value():
    outs = get_pool(2, timeout=3.0).outcomes(_send_transposed)
    assert not outs[0].ok and "not contiguous" in outs[0].message, outs[0].message


def test_on_a_gpu_each_send_waits_for_its_own_pieces_ready_mark():
    """A producer with consumers on two other ranks marks each value it makes; each of its sends passes the
    mark of the piece it sends (a stand-in mark on this CPU host, where the real one is a CUDA event)."""
    from runtime import executor

    plan = Plan([ActorSpec("p", lambda k: torch.full((2,), float(k)), out=((2,), torch.float32)),
                 ActorSpec("c1", lambda k, x: x, inputs=("p",), rank=1),
                 ActorSpec("c2", lambda k, x: x, inputs=("p",), rank=2)])
    marks, sent = iter(range(100, 200)), []
    with mock.patch.object(executor, "host_only", return_value=False), \
            mock.patch.object(executor, "world_device", return_value=torch.device("cuda", 0)), \
            mock.patch.object(executor, "channel_group", return_value=None), \
            mock.patch.object(executor.collectives, "ready_mark", side_effect=lambda device: next(marks)), \
            mock.patch.object(executor.collectives, "send_tensor",
                              side_effect=lambda t, dst, group, ready: sent.append((float(t[0]), dst, ready))):
        specs = {s.name: s for s in executor._local_specs(plan, 0)}
        values = [specs["p"].action(k) for k in range(3)]  # three pieces, marked 100, 101, 102
        for k in (0, 1, 2):
            specs["send:p->2"].action(k, values[k])
        for k in (0, 1, 2):
            specs["send:p->1"].action(k, values[k])
    assert sent == [(0.0, 2, 100), (1.0, 2, 101), (2.0, 2, 102), (0.0, 1, 100), (1.0, 1, 101), (2.0, 1, 102)]


def test_on_a_host_only_rank_producers_are_left_unwrapped():
    plan = Plan([ActorSpec("p", lambda k: k), ActorSpec("c", lambda k, x: x, inputs=("p",), rank=1)])
    from runtime import executor

    with mock.patch.object(executor, "channel_group", return_value=None):
        specs = {s.name: s for s in executor._local_specs(plan, 0)}
    assert specs["p"].action is plan.actors[0].action


def test_on_a_gpu_a_producer_off_the_compute_thread_runs_behind_its_inputs_marks_alone():
    """A boundary's cut (the copy thread) sends a compute actor's value: the compute actor marks each value it
    makes; the cut runs behind that mark alone (``after_marks``) and takes its own mark inside, which its send
    waits for. So the send never waits for compute queued after the value on the shared default stream."""
    from contextlib import contextmanager

    from runtime import executor

    plan = Plan([ActorSpec("F", lambda k: torch.full((2,), float(k))),
                 ActorSpec("cut", lambda k, x: x * 2, inputs=("F",), queue="copy", out=((2,), torch.float32)),
                 ActorSpec("asm", lambda k, x: x, inputs=("cut",), queue="copy", rank=1)])
    marks, events = iter(range(100, 200)), []

    def ready_mark(device):
        events.append(("mark", mark := next(marks), inside))
        return mark

    @contextmanager
    def after_marks(device, waits):
        nonlocal inside
        events.append(("behind", list(waits)))
        inside = True
        try:
            yield
        finally:
            inside = False

    inside = False
    with mock.patch.object(executor, "host_only", return_value=False), \
            mock.patch.object(executor, "world_device", return_value=torch.device("cuda", 0)), \
            mock.patch.object(executor, "channel_group", return_value=None), \
            mock.patch.object(executor.collectives, "ready_mark", side_effect=ready_mark), \
            mock.patch.object(executor.collectives, "after_marks", side_effect=after_marks), \
            mock.patch.object(executor.collectives, "send_tensor",
                              side_effect=lambda t, dst, group, ready: events.append(("send", float(t[0]), ready))):
        specs = {s.name: s for s in executor._local_specs(plan, 0)}
        values = [specs["F"].action(k) for k in range(2)]  # marked 100, 101 on the compute thread
        cuts = [specs["cut"].action(k, values[k]) for k in range(2)]
        for k in range(2):
            specs["send:cut->1"].action(k, cuts[k])
    assert events == [("mark", 100, False), ("mark", 101, False),
                      ("behind", [100]), ("mark", 102, True), ("behind", [101]), ("mark", 103, True),
                      ("send", 0.0, 102), ("send", 2.0, 103)], events
