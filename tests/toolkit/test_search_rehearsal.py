"""Rehearsals record what our dispatcher really does, and costs follow docs/design.md's table and the links."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import sbp_core as sc
from sbp_core.sbp import Broadcast, Split
from toolkit.search.cluster import cluster_from_dict
from toolkit.search.costmodel import collective_seconds
from toolkit.search.opcost import RooflineOpCosts
from toolkit.search.rehearsal import Collective, Rehearsal
from toolkit.search.stage_trace import StageSpec, global_input, trace_stage

B, S0, S1 = Broadcast(), Split(0), Split(1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(self.up(x).relu())


PLANS = {"replicated": {}, "megatron": {"up.weight": (B, S0), "down.weight": (B, S1)},
         "row_first": {"up.weight": (B, S1), "down.weight": (B, S0)}}


def _build(placement, plan):
    torch.manual_seed(0)
    m = sc.distribute_module(MLP(), placement, plan)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _spec(plan):
    return StageSpec(dp=1, tp=2, first=True, last=True, build=lambda p: (*_build(p, plan), None),
                     inputs=lambda p: (global_input((8, 16), torch.float32, p, (S0, B), requires_grad=True), {}),
                     forward=lambda m, x, labels: m(x).sum(), act_sbp=(S0, B), micro_batches=2)


def _real_step(plan_name):
    """On 2 real gloo ranks: the ledger of each phase of the step ``trace_stage`` rehearses."""
    p = sc.placement("cpu", [[0, 1]])
    m, opt = _build(p, PLANS[plan_name])
    out = {}
    for k in range(2):
        x = sc.distribute(torch.randn(8, 16), p, (S0, B), requires_grad=True)
        with sc.comm_ledger() as f:
            y = m(x).sum()
        with sc.comm_ledger() as b, sc.defer_grad_boxing():
            (y / 2).backward()
        out.setdefault("F", f.records)
        out["B0" if k == 0 else "B"] = b.records
    with sc.comm_ledger() as r:
        sc.box_grads(m)
    out["reduce"] = r.records
    return {k: [(x.op, x.ranks, x.bytes) for x in v] for k, v in out.items()}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_rehearsal_communicates_what_the_real_step_does(plan):
    from toolkit.rank_pool import get_pool

    real = get_pool(2).run(_real_step, plan)[0]
    tr = trace_stage(_spec(PLANS[plan]))
    for name in ("F", "B0", "B", "reduce"):
        assert [(c.op, c.ranks, c.bytes) for c in tr.phases[name].collectives] == real[name], name
    if plan == "megatron":  # nn.Linear is [out, in]: each rank multiplies by half of each weight
        mm = [tuple(c.args[0][1].shape) for c in tr.phases["F"].calls if c.op == "aten.mm.default"]
        assert mm == [(16, 16), (16, 16)]
        assert tr.param_bytes == (32 * 16 + 16 * 32) * 4 // 2
        # the logical graph: global ops with global shapes and the signature chosen for them
        g = [g for g in tr.phases["F"].global_ops if g.op == "aten.mm.default"]
        assert [g.shapes for g in g] == [((8, 16), (16, 32)), ((8, 32), (32, 16))]
        assert [g.outputs for g in g] == [((S0, S1),), ((S0, sc.sbp.partial_sum),)]
    assert tr.stash_bytes > 0


def test_rehearsal_leaves_no_world_behind():
    with Rehearsal(4):
        assert torch.distributed.is_initialized()
    assert not torch.distributed.is_initialized()


CLUSTER = {"name": "toy", "nodes": 2, "devices_per_node": 2,
           "device": {"memory_gib": 1, "peak_tflops": {"float32": 1.0}, "memory_bandwidth_gbs": 1.0},
           "links": {"intra_node": {"bandwidth_gbs": 10, "latency_us": 1},
                     "inter_node": {"bandwidth_gbs": 1, "latency_us": 10}}}


def test_collective_time_by_link_and_sharing():
    c = cluster_from_dict(CLUSTER)
    ar = Collective("all_reduce", (0, 1), 10**6)
    # inside a node: 2 steps of 1 us + 1 MB at 10 GB/s
    assert collective_seconds(ar, c, (0, 1), (0, 1)) == pytest.approx(2e-6 + 1e-4)
    # across nodes, both devices of the node at once: 2 x 10 us + 1 MB at 1 GB/s / 2
    assert collective_seconds(ar, c, (0, 2), (0, 1, 2, 3)) == pytest.approx(2e-5 + 2e-3)


def test_roofline_mm_and_views():
    from toolkit.search.rehearsal import OpCall, TensorSpec

    costs = RooflineOpCosts({"float32": 1e12}, 1e11)
    a, b = TensorSpec((64, 128), (128, 1), "float32"), TensorSpec((128, 256), (256, 1), "float32")
    mm = OpCall("aten.mm.default", ((a, b), ()), "")
    flops = 2 * 64 * 128 * 256
    nbytes = 4 * (64 * 128 + 128 * 256 + 64 * 256)
    assert costs.seconds(mm) == pytest.approx(max(flops / 1e12, nbytes / 1e11))
    view = OpCall("aten.view.default", ((a, (128, 64)), ()), "")
    assert costs.seconds(view) == 0.0


def test_bad_cluster_file_names_the_key():
    with pytest.raises(ValueError, match="unknown keys"):
        cluster_from_dict({**CLUSTER, "gpus": 3})


def _two_mm_trace():
    from toolkit.search.rehearsal import OpCall, PhaseTrace, TensorSpec

    big, small = TensorSpec((256, 256), (256, 1), "float32"), TensorSpec((8, 8), (8, 1), "float32")
    return PhaseTrace("F", [OpCall("aten.mm.default", ((big, big), ()), ""),
                            OpCall("aten.mm.default", ((small, small), ()), "")], [object()] * 3)


class _Fixed:  # 1 ms per call, whatever the call
    def seconds(self, call):
        return 1e-3


def test_phase_cost_threaded_part():
    """Without per-call gains, kernels torch splits over threads get the cluster's speedup; their work is conserved."""
    from toolkit.search.costmodel import phase_cost

    trace = _two_mm_trace()
    c = cluster_from_dict({**CLUSTER, "cores": 2, "costs": "measured",
                           "device": {**CLUSTER["device"], "thread_speedup": 2.0, "dispatch_us": 10}})
    two = phase_cost(trace, _Fixed(), c, 0, (0, 1), threads=2)  # rank 0 of a two-device stage
    assert (two.compute, two.host) == pytest.approx((1.5e-3, 3e-5))
    assert two.seconds == pytest.approx(1.5e-3 + 3e-5)
    # busy-thread seconds: both kernels' one-thread work (2 ms) and the dispatch
    assert two.thread_seconds == pytest.approx(2e-3 + 3e-5)
    one = phase_cost(trace, _Fixed(), c, 0, (0, 1), threads=1)
    assert (one.compute, one.thread_seconds) == pytest.approx((2e-3, 2e-3 + 3e-5))
    # a one-device stage runs on plain tensors (sc.runs_local): the same kernels, no dispatch
    alone = phase_cost(trace, _Fixed(), c, 0, (0,), threads=1)
    assert (alone.compute, alone.host, alone.thread_seconds) == pytest.approx((2e-3, 0.0, 2e-3))
    # so does a pure data-parallel stage (StageTrace.plain)
    dp = phase_cost(trace, _Fixed(), c, 0, (0, 1), threads=1, plain=True)
    assert (dp.compute, dp.host) == pytest.approx((2e-3, 0.0))


@pytest.mark.parametrize("plan,rows_weigh_equally,plain", [("replicated", True, True), ("replicated", False, False),
                                                           ("megatron", True, False)])
def test_a_stage_is_priced_plain_when_the_runtime_would_run_it_plain(plan, rows_weigh_equally, plain):
    from dataclasses import replace

    spec = replace(_spec(PLANS[plan]), rows_weigh_equally=rows_weigh_equally)
    assert trace_stage(spec).plain == plain


def test_phase_cost_per_call_gains():
    """Measured per-call gains replace the cluster's speedup, for every call, only when the process has threads."""
    from toolkit.search.costmodel import phase_cost

    class Gains:  # the big mm gains 1.6x, the small one 1.25x
        def gain(self, call):
            return 1.6 if call.args[0][0].shape[0] == 256 else 1.25

    trace = _two_mm_trace()
    c = cluster_from_dict({**CLUSTER, "cores": 2, "costs": "measured",
                           "device": {**CLUSTER["device"], "thread_speedup": 9.0, "kernel_factor": 2.0}})
    two = phase_cost(trace, _Fixed(), c, 0, (0,), threads=2, gains=Gains())
    # kernel_factor 2: 2 ms each alone in a step, then / 1.6 and / 1.25
    assert two.compute == pytest.approx(2e-3 / 1.6 + 2e-3 / 1.25)
    assert two.thread_seconds == pytest.approx(4e-3)  # the one-thread work: 1.6 threads busy for 1.25 ms, ...
    one = phase_cost(trace, _Fixed(), c, 0, (0,), threads=1, gains=Gains())
    assert one.compute == pytest.approx(4e-3)


def test_sync_latency_grows_with_processes():
    """Inside a node, a message step costs the ``sync`` curve's latency at the job's processes (interpolated)."""
    c = cluster_from_dict({**CLUSTER, "cores": 2, "costs": "measured", "sync": [[2, 100], [4, 300], [8, 1100]]})
    assert c.step_latency(2) == pytest.approx(100e-6)
    assert c.step_latency(6) == pytest.approx(700e-6)
    assert c.step_latency(1) == pytest.approx(100e-6)  # flat below the first point
    ar = Collective("all_reduce", (0, 1), 10**6)
    # 2 steps at the 4-process latency + 1 MB at 10 GB/s
    assert collective_seconds(ar, c, (0, 1), (0, 1), processes=4) == pytest.approx(2 * 300e-6 + 1e-4)
    # across nodes the network's own latency stays
    assert collective_seconds(ar, c, (0, 2), (0, 1, 2, 3), processes=4) == pytest.approx(2e-5 + 2e-3)
    # no curve: the link's latency
    plain = cluster_from_dict(CLUSTER)
    assert collective_seconds(ar, plain, (0, 1), (0, 1), processes=8) == pytest.approx(2e-6 + 1e-4)


def test_collective_waits_skew_of_the_compute_before_it():
    """A collective inside a node waits ``skew`` per second of compute since the phase's previous collective."""
    from toolkit.search.costmodel import phase_cost
    from toolkit.search.rehearsal import OpCall, PhaseTrace, TensorSpec

    c = cluster_from_dict({**CLUSTER, "cores": 2, "costs": "measured", "sync": [[2, 100], [4, 300]],
                           "skew": [[2, 0.1], [4, 0.3]]})
    assert (c.skew_fraction(2), c.skew_fraction(3), c.skew_fraction(8)) == pytest.approx((0.1, 0.2, 0.3))
    ar = Collective("all_reduce", (0, 1), 0)
    assert collective_seconds(ar, c, (0, 1), (0, 1), processes=2, segment=0.01) == pytest.approx(2e-4 + 1e-3)
    # across nodes no skew: the network's latency only
    assert collective_seconds(ar, c, (0, 2), (0, 1, 2, 3), processes=2, segment=0.01) == pytest.approx(2e-5)
    mm = OpCall("aten.mm.default", ((TensorSpec((8, 8), (8, 1), "float32"),) * 2, ()), "")
    # mm mm AR mm AR AR: the collectives wait 0.1 of 2 ms, of 1 ms and of nothing
    trace = PhaseTrace("F", [mm, mm, ar, mm, ar, ar], [])
    got = phase_cost(trace, _Fixed(), c, 0, (0, 1), processes=2)
    assert got.compute == pytest.approx(3e-3)
    assert got.comm == pytest.approx(3 * 2e-4 + 0.1 * 2e-3 + 0.1 * 1e-3)
    # no skew curve (roofline clusters, older cluster files): no wait
    assert cluster_from_dict(CLUSTER).skew_fraction(2) == 0.0


def test_thread_gain_measures_only_threadable_calls(tmp_path):
    from toolkit.search.rehearsal import OpCall, TensorSpec
    from toolkit.search.threadgain import MeasuredThreadGain

    path = tmp_path / "gains.json"
    gains = MeasuredThreadGain(path, threads=2, repeats=2, budget_s=0.0)
    small = TensorSpec((8, 8), (8, 1), "float32")
    assert gains.gain(OpCall("aten.mm.default", ((small, small), ()), "")) == 1.0
    gains.save()
    assert not path.exists()  # nothing measured: torch runs it on one thread
    big = TensorSpec((256, 256), (256, 1), "float32")
    mm = OpCall("aten.mm.default", ((big, big), ()), "")
    g = gains.gain(mm)  # measured (the clamp to [1, threads] is tested with a fake clock below)
    gains.save()
    key = repr(mm.key)
    assert json.loads(path.read_text())[key][0] == g
    # a gain measured on a quiet machine is kept; one measured under a far higher load than now is measured again
    path.write_text(json.dumps({key: [1.5, 0.0]}))
    assert MeasuredThreadGain(path).gain(mm) == 1.5
    path.write_text(json.dumps({key: [1.01, 1e9]}))
    again = MeasuredThreadGain(path, repeats=2, budget_s=0.0)
    again.gain(mm)
    again.save()
    assert json.loads(path.read_text())[key][1] < 1e9  # measured again: the stale entry's load is replaced
    with pytest.raises(ValueError, match="threads=1"):
        MeasuredThreadGain(path, threads=1)


@pytest.mark.parametrize("seconds, gain", [({1: 1.5, 2: 1.0}, 1.5), ({1: 3.0, 2: 1.0}, 2.0), ({1: 1.0, 2: 2.0}, 1.0)])
def test_thread_gain_is_the_one_thread_time_over_the_threaded_time_clamped_to_its_range(seconds, gain, monkeypatch):
    from toolkit.search import threadgain
    from toolkit.search.rehearsal import OpCall, TensorSpec

    clock = [0.0]

    def tick():  # every call of the op takes seconds[threads] on this clock
        clock[0] += seconds[torch.get_num_threads()]
        return clock[0]

    monkeypatch.setattr(threadgain.time, "perf_counter", tick)
    big = TensorSpec((256, 256), (256, 1), "float32")
    measured = threadgain.MeasuredThreadGain("/nonexistent/gains.json", threads=2, repeats=2, budget_s=0.0)
    assert measured.measure(OpCall("aten.mm.default", ((big, big), ()), "")) == gain


def test_op_costs_refresh_measures_the_files_calls_again(tmp_path):
    from toolkit.search.opcost import MeasuredOpCosts
    from toolkit.search.rehearsal import OpCall, TensorSpec

    path = tmp_path / "costs.json"
    spec = TensorSpec((8, 8), (8, 1), "float32")
    mm = OpCall("aten.mm.default", ((spec, spec), ()), "")
    path.write_text(json.dumps({repr(mm.key): 123.0}))  # measured under some load long ago
    assert MeasuredOpCosts(path).seconds(mm) == 123.0
    fresh = MeasuredOpCosts(path, repeats=2, budget_s=0.0, refresh=True)
    got = fresh.seconds(mm)
    assert 0.0 < got < 1.0 and fresh.seconds(mm) == got  # measured once, then kept for the process
    fresh.save()
    assert json.loads(path.read_text())[repr(mm.key)] == got


def test_an_expanded_argument_is_rebuilt_with_values():
    from toolkit.search.opcost import build_args
    from toolkit.search.rehearsal import TensorSpec

    t = build_args(TensorSpec((4, 3), (0, 1), "float32"))  # one row seen four times (an expand)
    assert t.shape == (4, 3) and t.stride() == (0, 1) and torch.equal(t[0], t[3]) and t.abs().sum() > 0


def test_a_local_view_the_shard_refuses_falls_back_to_a_copy_under_fake_tensors_too():
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from sbp_core.ops.views import _view_local

    aten = torch.ops.aten
    with FakeTensorMode():
        whole = torch.empty(4, 3 + 2 * 5)
        part = whole[:, 3:].view(4, 2, 5)  # strides (13, 5, 1): no view to (8, 5)
        out = _view_local(aten.view.default, (part, [8, 5]), {}, SimpleNamespace(local_out_shapes=[(8, 5)]))
    assert tuple(out.shape) == (8, 5)
