"""Wide&Deep trains like one device under dp2, dp4 and dp2_tp2, sparse optimizer included.

float64 (to 1e-9) and float32 (to 1e-5), dropout 0, 3 steps of the plan's layout (tables split over every rank:
wide ``S(0)``, deep ``S(1)``; MLP ``B``; batch ``(S(0), S(0))``) with sparse
table gradients, global-norm clipping (active) and ``LazyAdamW`` (AdamW for
the MLP, lazy Adam with moments for looked-up rows only on each rank's table
shard) against the same model and optimizer on one device with plain sparse
gradients, which trains on its own: losses and every parameter within the bar. ``sc.explain``
shows the lookups' path on dp2_tp2: ids gathered to ``B``, the wide rows
``P(sum)`` (kept partial through the logits' sum, reduce-scattered at the
loss), the deep rows ``S(2)``. One
pool call runs all layouts (dense moment storage equals sparse: tests/toolkit/test_lazy_adam.py).
"""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from recipes.wide_deep.model import WideDeep, WideDeepConfig, bce_loss
from recipes.wide_deep.plan import DATA_SBP, mesh_plan
from sbp_core.sbp import Broadcast, Partial, Split
from toolkit.lazy_adam import LazyAdamW
from toolkit.mesh import stage_ranks
from toolkit.rank_pool import get_pool

WORLD = 5
STEPS = 3
ROWS, BATCH = 3000, 16
LAYOUTS = {"dp2": (2, 1), "dp4": (4, 1), "dp2_tp2": (2, 2)}
B, P, S0, S1 = Broadcast(), Partial("sum"), Split(0), Split(1)
MAX_NORM = 0.5


def _batches(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 13, generator=gen).to(dtype), torch.randint(0, ROWS, (BATCH, 26), generator=gen),
             torch.randint(0, 2, (BATCH,), generator=gen).to(dtype)) for _ in range(STEPS)]


def _model(meta: bool, dtype=torch.float32) -> WideDeep:
    torch.manual_seed(0)
    return WideDeep(WideDeepConfig(table_rows=ROWS, embed_dim=8, hidden=[32, 16], dropout=0.0,
                                   meta_tables=meta)).to(dtype)


def _optimizer(model, dense_state: bool) -> LazyAdamW:
    tables = [model.wide.weight, model.deep.weight]
    rest = [p for n, p in model.named_parameters() if n not in ("wide.weight", "deep.weight")]
    return LazyAdamW([{"params": rest, "weight_decay": 0.1}, {"params": tables}], lr=3e-3, dense_state=dense_state)


def _clip_reference(params) -> None:
    """Global-norm clipping on one device, sparse gradients counted by their coalesced values."""
    sq = 0.0
    for p in params:
        g = p.grad.coalesce()._values() if p.grad.is_sparse else p.grad
        sq += float(g.pow(2).sum())
    coef = min(1.0, MAX_NORM / (sq ** 0.5 + 1e-6))
    for p in params:
        p.grad.mul_(coef)


def _reference(dense_state: bool, dtype=torch.float32):
    model = _model(meta=False, dtype=dtype)
    opt = _optimizer(model, dense_state)
    losses = []
    for dense, ids, label in _batches(dtype):
        loss = bce_loss(model(dense, ids), label)
        loss.backward()
        _clip_reference(list(model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _distributed(dp: int, tp: int, dense_state: bool = False, dtype=torch.float32):
    ranks = stage_ranks(dp, tp, 1)[0]
    p = sc.placement("cpu", ranks)
    model = sc.distribute_module(_model(meta=True, dtype=dtype), p, mesh_plan())
    opt = _optimizer(model, dense_state)
    grad_sbp, lookups = {}, None
    losses = []
    for dense, ids, label in _batches(dtype):
        x, i, y = (sc.distribute(t, p, DATA_SBP) for t in (dense, ids, label))
        with sc.explain() as steps:
            loss = bce_loss(model(x, i), y)
        if lookups is None:
            lookups = [(req, outs) for op, _, req, outs, _ in steps if op == "aten.embedding.default"]
            lookups.append(next((a[0], req[0]) for op, a, req, _, _ in steps
                                if op == "aten.binary_cross_entropy_with_logits.default"))
        loss.backward()
        grad_sbp = {n: (type(q.grad).__name__, sc.sbp.format_sbp(q.grad.sbp)) for n, q in model.named_parameters()
                    if n in ("wide.weight", "deep.weight")}
        sc.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().full_tensor()))
    params = {n: q.full_tensor().clone() for n, q in model.named_parameters()}
    return losses, params, grad_sbp, lookups


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _compare_all(dtype=torch.float32):
    """Worker: every layout against the reference; errors and the tables' gradient layouts."""
    out = {}
    ref_losses, ref_params = _reference(False, dtype)
    for name, (dp, tp) in LAYOUTS.items():
        if torch.distributed.get_rank() >= dp * tp:
            sc.placement("cpu", stage_ranks(dp, tp, 1)[0])  # placements are built by every rank
            continue
        losses, params, grad_sbp, lookups = _distributed(dp, tp, False, dtype)
        out[name] = (max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     max(_rel(params[k], ref_params[k]) for k in ref_params), grad_sbp, lookups)
    return out


@pytest.mark.parametrize("dtype, bar", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_layouts_match_one_device_with_lazy_adam(dtype, bar):
    results = get_pool(WORLD).run(_compare_all, dtype)
    seen = 0
    for rank_result in results:
        for name, (loss_err, param_err, grad_sbp, lookups) in rank_result.items():
            seen += 1
            assert loss_err <= bar and param_err <= bar, (name, loss_err, param_err)
            tp_axis = "S(1)" if name == "dp2_tp2" else "B"
            assert grad_sbp == {"wide.weight": ("SparseGlobalTensor", "(B, B)"),
                                "deep.weight": ("SparseGlobalTensor", f"(S(1), {tp_axis})")}, (name, grad_sbp)
            if name == "dp2_tp2":
                (wide_req, wide_out), (deep_req, deep_out), logits = lookups
                assert wide_req == [(S0, S0), (B, B)] and wide_out == [(P, P)], lookups  # ids gathered, rows partial
                assert deep_req == [(S1, S1), (B, B)] and deep_out == [(Split(2), Split(2))], lookups
                assert logits == ((P, P), (S0, S0)), lookups  # kept partial to the loss, reduce-scattered there
    assert seen == 2 + 4 + 4


def _one_device_pipeline_against_the_plain_loop():
    """Worker (rank 0 of a 1-rank pool): our pipeline step on one device, its sparse and dense gradients kept on
    the stage's leaves for lazy Adam (a handed-over sparse gradient fails), against ``PlainLoop`` (the same
    model class, seed, batches, optimizer and schedule, training on its own)."""
    import tempfile
    from unittest import mock

    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.plain_loop import PlainLoop
    from toolkit.trainer import Job

    cfg = compose(["recipe=wide_deep", "model=wide-deep-tiny", "model.dropout=0.0", "trainer.micro_batch_size=64",
                   "trainer.global_batch_size=64", "data.train_rows=5000", "data.val_rows=100", "logger=none",
                   "trainer.eval_every=0", "trainer.save_every=0", "trainer.max_steps=4", "device=cpu"],
                  run_dir=tempfile.mkdtemp())
    recipe = get("wide_deep")
    job, plain = Job(cfg, recipe), PlainLoop(cfg, recipe, "cpu")
    handed = mock.patch("sbp_core.one_device.SparseGlobalTensor", side_effect=AssertionError("a gradient was handed"))
    with handed:
        ours = [float(job.pipe.step(i)) for i in range(4)]
    theirs = [float(plain.step(i)) for i in range(4)]
    mine = {n: q.full_tensor() for n, q in job.module.named_parameters()}
    return ours, theirs, {n: _rel(mine[n], q.detach()) for n, q in plain.model.named_parameters()}


def test_one_device_pipeline_steps_lazy_adam_from_the_leaves_as_the_plain_loop():
    ours, theirs, param_err = get_pool(1).run(_one_device_pipeline_against_the_plain_loop)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)
    assert max(param_err.values()) <= 1e-5, param_err
    assert len(param_err) >= 6  # the tables and the MLP


def test_recipe_optimizer_keeps_dense_table_state_when_asked():
    """``build_optimizer(..., dense_table_state=True)`` (``model.dense_table_state``): the tables' moments are laid
    out like the tables (zeros where never looked up), not per-shard pieces of the looked-up rows; the step is
    the lazy one either way. The default keeps the pieces."""
    from omegaconf import OmegaConf

    from recipes.wide_deep.optim import build_optimizer

    trainer = OmegaConf.create(dict(lr=3e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1))
    dense, ids, label = _batches()[0]
    params = {}
    for dense_state in (True, False):
        torch.manual_seed(0)
        model = WideDeep(WideDeepConfig(table_rows=40, embed_dim=4, hidden=[8], dropout=0.0))
        opt = build_optimizer(model, trainer, dense_table_state=dense_state)
        bce_loss(model(dense, ids % 40), label).backward()
        opt.step()
        for table in (model.wide.weight, model.deep.weight):
            st = opt.state[table]
            if dense_state:
                assert "shards" not in st and st["exp_avg"].shape == table.shape, sorted(st)
                seen = torch.zeros(40, dtype=torch.bool)
                seen[torch.unique(ids % 40)] = True
                assert bool((st["exp_avg_sq"][~seen] == 0).all()) and bool((st["exp_avg_sq"][seen] > 0).any())
            else:
                assert "exp_avg" not in st and len(st["shards"]) == 1, sorted(st)
        params[dense_state] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params[True], params[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
