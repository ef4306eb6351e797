"""``step_on_locals``: an element-wise optimizer stepping the locals gives the dispatched step's values and state."""
from __future__ import annotations

import sys

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from sbp_core.dispatch import dispatch
from toolkit.rank_pool import get_pool

WORLD = 5
dispatch_code = dispatch.__code__

# On a (2, 2) mesh of ranks 0-3 (rank 4 holds nothing): split, replicated and mixed layouts, one uneven split.
LAYOUTS = [(sbp.split(0), sbp.split(1)), (sbp.broadcast, sbp.broadcast), (sbp.split(1), sbp.broadcast),
           (sbp.broadcast, sbp.split(0))]
SHAPES = [(6, 5), (6, 5), (4, 7), (5,)]
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:]}], lr=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def _dispatches(fn) -> int:
    """How many times ``fn()`` enters ``sbp_core.dispatch.dispatch``."""
    calls = [0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code is dispatch_code:
            calls[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def _run(kind, local: list):
    """Steps ``len(local)`` times (``local[i]``: step ``i`` on the locals); the parameters and state, full."""
    p = sc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    params = [torch.nn.Parameter(sc.distribute(torch.randn(s), p, lay)) for s, lay in zip(SHAPES, LAYOUTS)]
    opt = OPTIMIZERS[kind](params)
    for i, on_locals in enumerate(local):
        torch.manual_seed(100 + i)
        for q, lay in zip(params, LAYOUTS):
            q.grad = sc.distribute(torch.randn(q.shape), p, lay)
        if i == 1:
            params[1].grad = None  # a parameter without a gradient keeps its state untouched
        if on_locals:
            assert sc.steps_on_locals(opt)
            assert _dispatches(lambda: sc.step_on_locals(opt)) == 0  # no op went through __torch_dispatch__
        else:
            opt.step()
        assert all(q._local.grad is None for q in params)  # the locals do not keep the gradients
    for q in params:  # the state stays global, in the parameter's layout
        for k, v in opt.state[q].items():
            assert (k == "step") != isinstance(v, sc.GlobalTensor), (k, type(v))
            assert k == "step" or v.layout == q.layout, k
    state = [{k: v.full_tensor() if isinstance(v, sc.GlobalTensor) else v.clone() for k, v in opt.state[q].items()}
             for q in params]
    return [q.full_tensor() for q in params], state


def _compare(kind):
    want = _run(kind, [False] * 3)
    got = [_run(kind, [True] * 3), _run(kind, [True, False, True])]  # also: a dispatched step between local ones
    if torch.distributed.get_rank() == 4:
        return True
    return all(all(torch.equal(a, b) for a, b in zip(w_p, g_p))
               and all(w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w) for w, g in zip(w_s, g_s))
               for (w_p, w_s), (g_p, g_s) in [(want, g) for g in got])


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_step_on_locals_equals_the_dispatched_step(kind):
    assert all(get_pool(WORLD).run(_compare, kind))


def _fallbacks():
    p = sc.placement("cpu", [0, 1])
    q = torch.nn.Parameter(sc.distribute(torch.ones(4, 2), p, (sbp.broadcast,)))
    hooked = torch.optim.SGD([q], lr=1.0)
    hooked.register_step_pre_hook(lambda *a: None)
    # A gradient left partial (not boxed to the parameter's layout) takes the dispatched step, as do hooks.
    q.grad = sc.to_global(torch.full((4, 2), 0.5), placement=p, sbp=(sbp.partial_sum,))
    opt = torch.optim.SGD([q], lr=1.0)
    sc.step_on_locals(opt)
    after_partial = q.full_tensor().clone()
    sc.step_on_locals(hooked)
    # A parameter laid out partial: Adam's update of its terms is not the update of their sum, so
    # the local step must not run; the dispatched one refuses it loudly (no rule for addcdiv_ on P).
    part = torch.nn.Parameter(sc.to_global(torch.ones(4, 2), placement=p, sbp=(sbp.partial_sum,)))
    part.grad = sc.to_global(torch.ones(4, 2), placement=p, sbp=(sbp.partial_sum,))
    try:
        sc.step_on_locals(torch.optim.Adam([part]))
        partial = "stepped"
    except ValueError as exc:
        partial = str(exc)
    return sc.steps_on_locals(opt), sc.steps_on_locals(hooked), after_partial, q.full_tensor(), partial


def test_unboxed_gradients_partial_parameters_and_step_hooks_take_the_dispatched_step():
    for ok, hooked, after_partial, after, partial in get_pool(WORLD).run(_fallbacks)[:2]:
        assert ok and not hooked
        assert "cannot run with inputs" in partial, partial
        assert torch.equal(after_partial, torch.zeros(4, 2))  # 1 - (0.5 + 0.5)
        assert torch.equal(after, -torch.ones(4, 2))


def _fused_with_a_flag_through_the_dispatched_step():
    """A fused AdamW given fp16's overflow flag (``found_inf``, as ``PipelineStep.update`` hands it) whose
    gradient is left partial, so it takes the dispatched step: (after a clean flag, after an overflow flag)."""
    p = sc.placement("cpu", [0, 1])
    q = torch.nn.Parameter(sc.distribute(torch.ones(4, 2), p, (sbp.broadcast,)))
    opt = torch.optim.AdamW([q], lr=0.5, fused=True)
    out = []
    for flag in (0.0, 1.0):
        q.grad = sc.to_global(torch.full((4, 2), 0.5), placement=p, sbp=(sbp.partial_sum,))
        opt.found_inf, opt.grad_scale = torch.tensor(flag), None
        try:
            sc.step_on_locals(opt)
        finally:
            opt.found_inf = None
        out.append(q.full_tensor().clone())
    q.grad = sc.to_global(torch.full((4, 2), 0.5), placement=p, sbp=(sbp.partial_sum,))
    opt.grad_scale = torch.tensor(1024.0)  # still-scaled gradients: the unfused step cannot unscale them
    try:
        sc.step_on_locals(opt)
        out.append("stepped")
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_a_fused_optimizers_overflow_flag_is_read_by_the_dispatched_step_too():
    """The dispatched fallback runs the single-tensor update, which refuses the fused-only flags: it reads the
    overflow flag itself (an overflow skips the step) and hands the update none; scaled gradients it refuses."""
    for stepped, skipped, scaled in get_pool(WORLD).run(_fused_with_a_flag_through_the_dispatched_step)[:2]:
        assert (stepped < 1).all() and torch.equal(skipped, stepped)
        assert "unscale the gradients first" in scaled, scaled


def test_a_state_changed_between_local_steps_is_what_the_next_one_reads():
    """The locals' view of the optimizer is kept between steps; a replaced state entry, a loaded state dict and a
    new parameter group are seen by the next step (the same values as dispatched steps through the same events)."""
    p = sc.placement("cpu", [0])
    s0 = (sbp.split(0),)

    def run(local: bool):
        torch.manual_seed(0)
        q = torch.nn.Parameter(sc.distribute(torch.randn(4, 3), p, s0))
        r = torch.nn.Parameter(sc.distribute(torch.randn(5), p, (sbp.broadcast,)))
        opt = torch.optim.AdamW([q], lr=0.1)

        def step(i):
            for t in opt.param_groups[-1]["params"] + [q]:
                t.grad = sc.distribute(torch.full(t.shape, float(i + 1)), p, t.sbp)
            sc.step_on_locals(opt) if local else opt.step()

        step(0)
        step(1)
        sd = opt.state_dict()
        saved = {**sd, "state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}}
        opt.state[q]["exp_avg"] = sc.distribute(torch.ones(4, 3), p, s0)  # a replaced entry
        step(2)
        opt.load_state_dict(saved)  # a new state object, of other tensors: back to after step 1
        step(3)
        opt.add_param_group({"params": [r]})
        step(4)
        return [t.full_tensor() for t in (q, r)] + [v.full_tensor() if isinstance(v, sc.GlobalTensor) else v
                                                    for t in (q, r) for v in opt.state[t].values()]

    want, got = run(False), run(True)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


def _partial_parameters_refused():
    """A parameter laid out partial never steps its terms: each way to step it raises, naming why."""
    from toolkit.lazy_adam import LazyAdamW

    p = sc.placement("cpu", [0, 1])
    out = []
    for step in ("lazy_adam", "local_grads"):
        part = torch.nn.Parameter(sc.to_global(torch.ones(4, 2), placement=p, sbp=(sbp.partial_sum,)))
        grad = sc.to_global(torch.ones(4, 2), placement=p, sbp=(sbp.partial_sum,))
        try:
            if step == "lazy_adam":  # its dense step over global tensors: no rule runs Adam's in-place ops on P
                part.grad = grad
                LazyAdamW([part], lr=0.1).step()
            else:  # a one-device step's local gradients
                sc.step_on_locals(torch.optim.SGD([part], lr=0.1), grads={id(part): grad._local})
            out.append("stepped")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_a_partial_parameter_is_refused_by_lazy_adam_and_with_local_gradients():
    for lazy, local in get_pool(WORLD).run(_partial_parameters_refused)[:2]:
        assert "cannot run with inputs" in lazy, lazy
        assert "laid out partial" in local, local
