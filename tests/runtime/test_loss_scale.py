"""fp16's dynamic loss scale: GradScaler's schedule, one skip decision for the whole job, exact unscaling.

An inf planted in one gradient on one rank (of dp2_tp2, and of pp2's last
stage) must make every rank skip that step (no parameter moves anywhere) and
halve the scale everywhere; the steps around it update as usual. With a
power-of-two scale and no overflow, scaling then unscaling is exact, so the
scaled pipeline matches one device training on its own (float64, 1e-9).
"""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core.process_groups import world_rank
from benchkit.pipeline_parity import build, compare, run_pipeline
from toolkit.rank_pool import get_pool


def test_the_scale_moves_as_grad_scaler_moves_it():
    overflows = [False, False, False, True, False, True, True, False, False, False, False, False, True, False]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**5, growth_interval=3)
    ours = sc.LossScaler(2.0**5, growth_interval=3)
    for inf in overflows:
        loss = model(torch.randn(3, 4)).sum()
        ref.scale(loss).backward()
        if inf:
            model.weight.grad[0, 0] = float("inf")
        ref.step(opt)
        ref.update()
        opt.zero_grad()
        ours.update(inf)
        assert ours.scale == ref.get_scale()
    assert ours.state_dict() == {"scale": ref.get_scale(), "growth_tracker": int(ref._growth_tracker)}


def test_bad_scaler_settings_are_refused():
    with pytest.raises(ValueError, match="backoff_factor"):
        sc.LossScaler(backoff_factor=1.5)


class _Planting(sc.LossScaler):
    """Puts an inf into one gradient of rank ``victim`` just before the ``at``-th unscale."""

    def __init__(self, at: int, victim: int):
        super().__init__(2.0**10)
        self.at, self.victim, self.calls = at, victim, 0

    def found_inf(self, params, stages=None):
        self.calls += 1
        if self.calls == self.at and world_rank() == self.victim:
            grad = next(p.grad for p in params if p.grad is not None)
            grad._local.view(-1)[-1] = float("inf")
        return super().found_inf(params, stages)


def _skips(dp: int, tp: int, pp: int, victim: int, fused: bool):
    """Worker: per step ``(any local parameter or optimizer state changed, skipped, scale after, the step
    read the device)``; rank ``victim`` overflows in step 1."""
    from tests.toolkit.host_reads import HostReads

    scaler = _Planting(at=2, victim=victim)
    step, module = build(dp, tp, pp, loss_scale=scaler, fused=fused)
    out = []
    for i in range(3):
        state = [] if module is None else [p.to_local() for p in module.parameters()] + [
            v.to_local() if isinstance(v, sc.GlobalTensor) else v
            for s in step.optimizer.state.values() for v in s.values()]
        before = [t.clone() for t in state]
        with HostReads() as reads:
            step.step(i)
        after = [] if module is None else [p.to_local() for p in module.parameters()] + [
            v.to_local() if isinstance(v, sc.GlobalTensor) else v
            for s in step.optimizer.state.values() for v in s.values()]
        changed = len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after))
        out.append((changed, bool(step.skipped), scaler.scale, reads.ops["aten::_local_scalar_dense"] > 0))
    return out if module is not None else None


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("dp,tp,pp,victim", [(2, 2, 1, 3), (1, 1, 2, 1)], ids=["dp2_tp2", "pp2"])
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(dp, tp, pp, victim, fused):
    """Parameters and optimizer state stay as they were on every rank; with the fused kernel the flag never
    leaves the device (no host read in any step, counted where the step runs on the calling thread)."""
    res = [r for r in get_pool(8).run(_skips, dp, tp, pp, victim, fused) if r is not None]
    assert len(res) == dp * tp * pp
    for rank, steps in enumerate(res):
        assert [s[0] for s in steps] == [True, False, True], (rank, steps)
        assert [s[1] for s in steps] == [False, True, False], (rank, steps)
        assert [s[2] for s in steps] == [2.0**10, 2.0**9, 2.0**9], (rank, steps)
        if pp == 1:  # the step runs on the calling thread, where the probe counts (a pipeline's compute has one)
            assert [s[3] for s in steps] == [not fused] * 3, (rank, steps)


def test_a_scaled_pipeline_matches_one_device():
    # float64: scaling by a power of two and unscaling is exact, so the tight bar holds.
    res = get_pool(8).run(run_pipeline, "tp2_pp2", 2, "1f1b", 8, None, 2.0**12, dtype="float64")
    errs = compare(res, 2, dtype="float64")
    assert all(e <= 1e-9 for e in errs), errs


def _mixed_dtype_overflow(where: int):
    """Gradients in float32 and float64 (two of GradScaler's groups); an inf in group ``where`` only."""
    p = sc.placement("cpu", [0, 1])
    params = [sc.distribute(torch.ones(4, dtype=dt), p, sc.sbp.broadcast, requires_grad=True)
              for dt in (torch.float32, torch.float64)]
    for q in params:
        q.grad = sc.distribute(torch.full((4,), 8.0, dtype=q.dtype), p, sc.sbp.broadcast)
    params[where].grad._local[1] = float("inf")
    scaler = sc.LossScaler(2.0**2)
    found = float(scaler.found_inf(params))
    return found, [q.grad._local.tolist() for q in params]


@pytest.mark.parametrize("where", [0, 1])
def test_an_overflow_in_any_dtype_group_is_found(where):
    for found, grads in get_pool(2).run(_mixed_dtype_overflow, where):
        assert found == 1.0
        clean = grads[1 - where]
        assert clean == [2.0] * 4  # unscaled by the scale, 4
