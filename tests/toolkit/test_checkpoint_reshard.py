"""Checkpoints reshard: saved under one layout, loaded under others, every value equal (AdamW state included).

A tiny GPT-2 trains two AdamW steps under dp2 x tp2 (Megatron's plan) and is
saved with its optimizer, scheduler, sampler, step and RNG states. It is then
loaded into a single rank, tp4, dp4 and a two-stage split (ranks hold
different parameters; the last stage holds its own copy of the tied
embedding), each rank checking its shards exactly against the saved run's
full tensors. The two-stage state is saved again (the tied copy stored once)
and loaded back into a single rank. Partial, uneven and nested-split tensors
round-trip too.
"""
import fnmatch
import json
import os

import pytest
import torch
import torch.distributed as dist

import sbp_core as sc
from recipes.gpt2.model import GPT2LMHeadModel
from sbp_core import GlobalTensor
from sbp_core.layout import box_slices, local_box
from sbp_core.sbp import Broadcast, Partial, Split
from benchkit.parity import GPT_CFG, GPT_TP, _on_axis
from toolkit import checkpoint as ckpt
from toolkit.rank_pool import get_pool

WORLD = 4
B, S0, S1 = Broadcast(), Split(0), Split(1)
TIED = [("transformer.wte.weight", "lm_head.weight")]
DP2_TP2 = _on_axis(GPT_TP, B, 1, 2)
STAGE0 = ("transformer.wte.", "transformer.wpe.", "transformer.h.0.")


def _model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT_CFG)


def _full(t):
    return t.full_tensor() if isinstance(t, GlobalTensor) else t.detach().clone()


def _sbp(plan, name, ndim):
    for pattern, sbp in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return sbp if isinstance(sbp, tuple) else (sbp,)
    return (B,) * ndim


def _params(layout):
    """``{name: global parameter}`` this rank holds under ``layout`` (every rank builds every placement)."""
    model = _model()
    if layout != "pp2":
        ranks, plan = {"single": ([0], {}), "tp4": ([0, 1, 2, 3], GPT_TP), "dp4": ([0, 1, 2, 3], {}),
                       "dp2_tp2": ([[0, 1], [2, 3]], DP2_TP2)}[layout]
        sc.distribute_module(model, sc.placement("cpu", ranks), plan)
        return model, dict(model.named_parameters())
    # Two stages: tp2 on ranks 0-1 (embeddings, block 0), dp2 on ranks 2-3 (block 1, ln_f, LM head).
    stage0, stage1 = sc.placement("cpu", [0, 1]), sc.placement("cpu", [2, 3])
    full = dict(model.named_parameters())
    full["lm_head.weight"] = full["transformer.wte.weight"]
    me = dist.get_rank()
    out = {}
    for name, value in full.items():
        first = name.startswith(STAGE0)
        if (me in stage0.ranks) == first:
            p, plan = (stage0, GPT_TP) if first else (stage1, {})
            out[name] = torch.nn.Parameter(sc.distribute(value.detach(), p, _sbp(plan, name, 1)))
    return None, out


def _optimizer(params, lr=1e-3):
    decay = [p for n, p in params.items() if p.dim() >= 2]
    rest = [p for n, p in params.items() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train_and_save(root):
    """Worker: two AdamW steps under dp2 x tp2, save; rank 0 returns the full reference values."""
    model, params = _params("dp2_tp2")
    p = next(iter(params.values())).placement
    opt = _optimizer(params)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    torch.manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, GPT_CFG.vocab_size, (4, 16))
        x = sc.distribute(ids, p, (S0, B))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = {"model": model.state_dict(), "optim": ckpt.optimizer_state_dict(opt, model),
             "scheduler": sched.state_dict(), "sampler": {"epoch": 0, "index": 8}, "step": 2,
             "rng": ckpt.rng_state(), "extra": {"layout": "dp2_tp2", "betas": (0.9, 0.95)}}
    path = ckpt.save(root, 2, state, keep_last=2, tied=TIED)
    ref = {"model": {n: _full(q) for n, q in params.items()},
           "optim": {n: {k: _full(v) for k, v in opt.state[q].items()} for n, q in params.items()},
           "lrs": [g["lr"] for g in opt.param_groups], "scheduler": sched.state_dict()}
    return path, (ref if dist.get_rank() == 0 else None)


def _worst(local_value, global_like, full):
    """Largest difference between this rank's local tensor and its box of ``full`` (0.0 when equal)."""
    if isinstance(global_like, GlobalTensor):
        me = dist.get_rank()
        if me not in global_like.placement:
            return 0.0
        box = local_box(full.shape, global_like.placement.shape, global_like.sbp, global_like.placement.coords(me))
        full = full[box_slices(box)]
        local_value = global_like._local
    if local_value.shape != full.shape or local_value.dtype != full.dtype:
        return float("inf")
    return (local_value.double() - full.double()).abs().max().item() if full.numel() else 0.0


def _by_name(table, name):
    """``table[name]``, a tied name standing for the embedding it shares."""
    return table[name] if name in table else table["transformer.wte.weight"]


def load_and_check(root, layout, ref, save_again=None):
    """Worker: load into ``layout``; returns the largest difference to ``ref`` and the loaded plain values."""
    model, params = _params(layout)
    opt = _optimizer(params, lr=123.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = model.state_dict() if model is not None else dict(params)
    template = {"model": state, "optim": ckpt.optimizer_state_dict(opt, params), "scheduler": None,
                "sampler": None, "step": None, "rng": None, "extra": None}
    out = ckpt.load(root, template)
    ckpt.load_optimizer_state_dict(opt, params, out["optim"])
    sched.load_state_dict(out["scheduler"])
    worst = 0.0
    for name, q in params.items():
        worst = max(worst, _worst(q, q, _by_name(ref["model"], name)))
        saved = _by_name(ref["optim"], name)
        if set(opt.state[q]) != set(saved):
            return f"{name}: optimizer state keys {sorted(opt.state[q])} != {sorted(saved)}"
        for key, value in opt.state[q].items():
            worst = max(worst, _worst(value, value, saved[key]))
            if isinstance(value, GlobalTensor) and value.placement != q.placement:
                return f"{name}.{key} is on {value.placement}, its parameter on {q.placement}"
    for name, value in state.items():  # tied names in the module's state dict too
        worst = max(worst, _worst(value, value, _by_name(ref["model"], name)))
    plain = {"lrs": [g["lr"] for g in opt.param_groups], "betas": opt.param_groups[0]["betas"],
             "scheduler": sched.state_dict(), "sampler": out["sampler"], "step": out["step"],
             "extra": out["extra"], "rng_is_tensor": isinstance(out["rng"]["torch"], torch.Tensor)}
    if save_again is not None:
        again = {"model": state, "optim": ckpt.optimizer_state_dict(opt, params), "scheduler": sched.state_dict(),
                 "sampler": out["sampler"], "step": out["step"], "rng": ckpt.rng_state(), "extra": out["extra"]}
        ckpt.save(save_again, out["step"], again, tied=TIED)
    return worst, plain


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "dp2_tp2")
    results = get_pool(WORLD).run(train_and_save, root)
    return root, results[0][1], results[0][0]


def test_save_layout_on_disk(saved):
    root, _, path = saved
    assert ckpt.latest(root) == path and os.path.basename(path) == "step_2"
    names = sorted(os.listdir(path))
    assert names == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "manifest.json",
                     "metadata.json", "state.json"]
    with open(os.path.join(path, "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    # c_attn.weight is (B, S(1)) on the (dp, tp) mesh: two column boxes, each written once (not per dp replica).
    chunks = tensors["model/transformer.h.0.attn.c_attn.weight"]["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [0, 96]] and [c["sizes"] for c in chunks] == [[64, 96]] * 2
    assert "model/lm_head.weight" not in tensors  # tied to wte: stored once
    with open(os.path.join(path, "state.json")) as f:
        doc = json.load(f)
    assert doc["aliases"] == {"model/lm_head.weight": "model/transformer.wte.weight"}
    assert sorted(doc["per_rank"]) == ["0", "1", "2", "3"]
    assert doc["layouts"]["model/transformer.h.0.attn.c_attn.weight"] == {"placement": [[0, 1], [2, 3]],
                                                                         "sbp": "(B, S(1))"}
    data = sum(os.path.getsize(os.path.join(path, n)) for n in names if n.endswith(".distcp"))
    model_bytes = sum(t.numel() * 4 for t in _model().parameters())
    assert data < 3 * model_bytes * 1.3  # params + 2 AdamW states, once each (plus record overhead)


@pytest.mark.parametrize("layout", ["single", "tp4", "dp4", "pp2"])
def test_load_into_other_layouts(saved, layout):
    root, ref, _ = saved
    results = get_pool(WORLD).run(load_and_check, root, layout, ref)
    for r, res in enumerate(results):
        assert not isinstance(res, str), f"rank {r}: {res}"
        worst, plain = res
        assert worst == 0.0, f"rank {r}: max difference {worst}"
        assert plain["lrs"] == ref["lrs"] and plain["betas"] == (0.9, 0.95)
        assert plain["scheduler"] == ref["scheduler"]
        assert plain["sampler"] == {"epoch": 0, "index": 8} and plain["step"] == 2
        assert plain["extra"] == {"layout": "dp2_tp2", "betas": (0.9, 0.95)} and plain["rng_is_tensor"]


def test_pipeline_stages_save_tied_copy_once_and_load_into_single(saved, tmp_path):
    root, ref, _ = saved
    again = str(tmp_path / "pp2")
    pool = get_pool(WORLD)
    for worst, _ in pool.run(load_and_check, root, "pp2", ref, save_again=again):
        assert worst == 0.0
    with open(os.path.join(ckpt.latest(again), "state.json")) as f:
        aliases = json.load(f)["aliases"]
    assert aliases["model/lm_head.weight"] == "model/transformer.wte.weight"
    assert aliases["optim/state/lm_head.weight/exp_avg"] == "optim/state/transformer.wte.weight/exp_avg"
    for worst, plain in pool.run(load_and_check, again, "single", ref):
        assert worst == 0.0 and plain["lrs"] == ref["lrs"]


def test_single_rank_placement_saves_in_a_larger_world(saved, tmp_path):
    # Ranks 1-3 hold nothing under "single"; the tied LM head is still saved once, as an alias.
    root, ref, _ = saved
    again = str(tmp_path / "single")
    pool = get_pool(WORLD)
    for worst, _ in pool.run(load_and_check, root, "single", ref, save_again=again):
        assert worst == 0.0
    with open(os.path.join(ckpt.latest(again), "state.json")) as f:
        assert json.load(f)["aliases"] == {"model/lm_head.weight": "model/transformer.wte.weight"}
    for worst, _ in pool.run(load_and_check, again, "tp4", ref):
        assert worst == 0.0


def save_odd_layouts(root):
    """Worker: a partial tensor, an uneven split and a nested split of one dim; returns their full values."""
    torch.manual_seed(5)
    a, b, c = torch.randn(10, 6), torch.randn(7, 5), torch.randn(10, 3)
    me = dist.get_rank()
    p2, p4, p22 = (sc.placement("cpu", r) for r in ([0, 1], [0, 1, 2, 3], [[0, 1], [2, 3]]))
    ga = sc.to_global(a / 2 if me in p2 else None, p2, Partial("sum"))  # a/2 + a/2 == a exactly
    gb = sc.distribute(b, p22, (S0, S0))  # rows 7 -> (4, 3) -> (2, 2), (2, 1)
    gc = sc.distribute(c, p4, S0)  # rows 10 -> 3, 3, 2, 2
    ckpt.save(root, 7, {"t": {"a": ga, "b": gb, "c": gc}, "plain": torch.arange(5)})
    return a, b, c


def load_odd_layouts(root, full):
    """Worker: load the odd layouts into other odd layouts; returns the largest difference."""
    a, b, c = full
    p23, p3, p4, p22 = (sc.placement("cpu", r) for r in ([2, 3], [0, 1, 2], [0, 1, 2, 3], [[0, 1], [2, 3]]))
    ta = sc.zeros(10, 6, placement=p23, sbp=Partial("sum"))
    tb = sc.zeros(7, 5, placement=p3, sbp=S1)
    tc = sc.zeros(10, 3, placement=p22, sbp=(S1, S0))
    tc2 = sc.zeros(10, 3, placement=p4, sbp=B)
    out = ckpt.load(root, {"t": {"a": ta, "b": tb, "c": tc}, "plain": torch.zeros(5, dtype=torch.int64)})
    out2 = ckpt.load(root, {"t": {"c": tc2}})
    me = dist.get_rank()
    worst = max(_worst(tb, tb, b), _worst(tc, tc, c), _worst(tc2, tc2, c))
    if me == 2:
        worst = max(worst, (ta._local - a).abs().max().item())
    if me == 3:
        worst = max(worst, ta._local.abs().max().item())  # the partial axis' other rank holds zeros
    ok = torch.equal(out["plain"], torch.arange(5)) and out2["t"]["c"] is tc2 and out["t"]["a"] is ta
    return worst, ok


def test_partial_uneven_and_nested_splits(tmp_path):
    pool = get_pool(WORLD)
    root = str(tmp_path / "odd")
    full = pool.run(save_odd_layouts, root)[0]
    for worst, ok in pool.run(load_odd_layouts, root, full):
        assert worst == 0.0 and ok


def load_wrong_shape(root):
    """Worker: a template whose tensor has another shape than the saved one."""
    _, params = _params("tp4")
    bad = {"model": {"transformer.wpe.weight": sc.zeros(16, 64, placement=sc.placement("cpu", [0, 1]), sbp=S0)}}
    return ckpt.load(root, bad)


def test_wrong_shape_is_refused_on_every_rank(saved):
    root, _, _ = saved
    outcomes = get_pool(WORLD).outcomes(load_wrong_shape, root)
    for o in outcomes:
        assert not o.ok and o.exc_type == "CheckpointError"
        assert "model/transformer.wpe.weight" in o.message and "[32, 64]" in o.message


def _save_per_rank(root):
    ckpt.save(root, 1, {"rng": {"rank": dist.get_rank()}, "step": 1}, per_rank=("rng",))


def _load_per_rank(root):
    return ckpt.load(root)["rng"]["rank"]


def test_a_larger_world_takes_each_ranks_state_from_rank_modulo_the_saved_world(tmp_path):
    """Saved by 2 ranks, loaded by 4: ranks 2 and 3 resume ranks 0's and 1's per-rank state (RNG, sampler)."""
    root = str(tmp_path / "ckpt")
    get_pool(2).run(_save_per_rank, root)
    assert get_pool(WORLD).run(_load_per_rank, root) == [0, 1, 0, 1]
