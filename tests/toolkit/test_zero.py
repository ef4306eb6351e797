"""ZeRO stages 1-3 train the tiny GPT-2 exactly like stage 0 (plain data parallel via distribute_module),
and in float64 like one device training on its own (1e-9, every step's loss and parameters).

fp32, dropout 0, AdamW, 5 steps from the same seed and batches: after every
step every master equals stage 0's parameter to 1e-6 (max relative
difference per tensor) on dp2, dp4 and dp2 x tp2. bf16 compute copies stay
within 1e-2 of the fp32 loss. Memory counted from the tensors each rank
holds equals the ZeRO paper's formulas on dp4, and the ledger's bytes per
step are 2Ψ (stages 1-2) and between 2Ψ and 3Ψ (stage 3: backward gathers
again only the weights an op saved) times (N-1)/N.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import sbp_core as sc
from recipes.gpt2.model import GPT2LMHeadModel
from toolkit.zero import apply_zero, check_stage, formula_bytes, held_bytes, model_elements, traffic_formula
from benchkit.parity import GPT_CFG, GPT_TP, GPT_TP_PINS, _on_axis
from sbp_core.sbp import Broadcast, Split
from toolkit.rank_pool import get_pool

WORLD = 5
STEPS = 5
B, S0 = Broadcast(), Split(0)
MESHES = {
    "dp2": ([0, 1], {}, (S0,)),
    "dp4": ([0, 1, 2, 3], {}, (S0,)),
    "dp2_tp2": ([[0, 1], [2, 3]], _on_axis({**GPT_TP, **GPT_TP_PINS}, B, 1, 2), (S0, B)),
}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _step_and_compare(zero, opt, model, loss, ref, want, p, worst: float) -> float:
    """ZeRO's optimizer step, then ``worst`` raised to the loss's and every parameter's relative error
    against the reference's (``want``, ``ref``) on the members of ``p`` (the full values are gathered on
    every rank)."""
    zero.sync_grads()
    opt.step()
    opt.zero_grad()
    got, params = loss.full_tensor(), [q.full_tensor() for q in model.parameters()]
    if torch.distributed.get_rank() not in p:
        return worst
    return max(worst, abs(got.item() - want.item()) / abs(want.item()),
               *(_rel(q, r) for q, r in zip(params, ref.parameters())))


def _train(mesh: str, stage: int, dtype=None, micro: int = 1, steps: int = STEPS, defer: bool = True,
           shards=None, precision=torch.float32):
    """Train on every rank; members return (losses, params after each step, last step's ledger, bytes, Ψ, N, #units).

    ``defer``: stage 0 accumulates micro-batch gradients unreduced and reduces once (``defer_grad_boxing``).
    ``shards``: the optimizer steps the masters' local tensors (default: all but the fp32 stage-0 reference,
    which steps the global parameters with torch's AdamW, verify_parity's way).
    """
    ranks, plan, in_sbp = MESHES[mesh]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT_CFG).to(precision)
    batches = [torch.randint(0, GPT_CFG.vocab_size, (8, 16)) for _ in range(steps * micro)]
    p = sc.placement("cpu", ranks)
    model, zero = apply_zero(model, p, plan, stage=stage, dp_axis=0, compute_dtype=dtype)
    shards = stage > 0 or dtype is not None if shards is None else shards
    opt = zero.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, shards=shards)
    losses, params = [], []
    for step in range(steps):
        with sc.comm_ledger() as ledger:
            for k in range(micro):
                x = sc.distribute(batches[step * micro + k], p, in_sbp)
                with sc.defer_grad_boxing() if defer else contextlib.nullcontext():
                    loss = model(x, x)[1]
                    (loss / micro).backward()
            mem = held_bytes(zero, opt)
            zero.sync_grads()
            sc.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)).full_tensor())
        params.append({n: q.full_tensor().clone() for n, q in model.named_parameters()})
    if torch.distributed.get_rank() not in p:
        return None
    return [v.item() for v in losses], params, ledger, mem, model_elements(zero), p.shape[0], len(zero.units)


def _summary(got, ref) -> dict:
    losses, params, ledger, mem, psi, n, n_units = got
    return dict(param_err=max(_rel(a[k], r[k]) for a, r in zip(params, ref[1]) for k in a),
                loss_err=max(abs(a - r) / abs(r) for a, r in zip(losses, ref[0])),
                by_op=ledger.by_op(), reduce_scatters=ledger.count("reduce_scatter"),
                mem=mem, psi=psi, n=n, n_units=n_units)


def _compare(mesh: str, runs: list, micro: int = 1, steps: int = STEPS):
    """Worker: ``runs`` of (stage, dtype, defer[, shards]), each against the stage-0 fp32 run with the same ``defer``.

    The first entry of the result summarises the (deferred) stage-0 reference itself.
    """
    refs = {}
    out = []
    for stage, dtype, defer, *shards in [(0, None, True)] + list(runs):
        if defer not in refs:
            refs[defer] = _train(mesh, 0, micro=micro, steps=steps, defer=defer)
        if (stage, dtype) == (0, None) and not shards:
            got = refs[defer]
        else:
            got = _train(mesh, stage, dtype, micro, steps, shards=shards[0] if shards else None)
        out.append(None if got is None else _summary(got, refs[defer]))
    return out


@pytest.fixture(scope="module")
def pool():
    return get_pool(WORLD)


def _one_device(steps: int = STEPS):
    """The same training on one device, on its own (float64): per-step losses and parameters."""
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(GPT_CFG).double()
    batches = [torch.randint(0, GPT_CFG.vocab_size, (8, 16)) for _ in range(steps)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    losses, params = [], []
    for x in batches:
        loss = ref(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append({n: q.detach().clone() for n, q in ref.named_parameters()})
    return losses, params


def _against_one_device(mesh: str, stages):
    """Worker: each ZeRO stage trained in float64 against one device training on its own."""
    ref = _one_device()
    out = []
    for stage in stages:
        got = _train(mesh, stage, precision=torch.float64)
        out.append(None if got is None else _summary(got, ref))
    return out


@pytest.mark.parametrize("mesh", ["dp2", "dp2_tp2"])
def test_float64_stages_equal_one_device_training_on_its_own(pool, mesh):
    """Stages 0-3, every step's loss and parameters, against an independent one-device AdamW run."""
    for rank, res in enumerate(pool.run(_against_one_device, mesh, (0, 1, 2, 3))):
        for stage, r in enumerate(res):
            if r is not None:
                assert r["param_err"] <= 1e-9 and r["loss_err"] <= 1e-9, (mesh, rank, stage, r["param_err"],
                                                                          r["loss_err"])


@pytest.mark.parametrize("mesh,stages", [("dp2", (1, 2, 3)), ("dp2_tp2", (2, 3))])  # dp4 below
def test_fp32_stages_equal_stage0(pool, mesh, stages):
    """Stages 1-3 and stage 0 stepping local shards equal stage 0 stepping global parameters."""
    runs = [(s, None, True) for s in stages] + [(0, None, True, True)]
    res = pool.run(_compare, mesh, runs)[0][1:]
    for (stage, *_), r in zip(runs, res):
        assert r["param_err"] <= 1e-6 and r["loss_err"] <= 1e-6, (mesh, stage, r["param_err"], r["loss_err"])


def test_dp4_parity_memory_and_traffic_match_formulas(pool):
    """fp32 stages 1-3 equal stage 0; bf16 within 1e-2 of fp32's loss; bytes held and sent by the formulas."""
    runs = [(0, None, True)] + [(s, d, True) for d in (None, torch.bfloat16) for s in (1, 2, 3)] + [(0, torch.bfloat16, True)]
    res = pool.run(_compare, "dp4", runs[1:])[0]
    for (stage, dtype, _), r in zip(runs, res):
        mixed = dtype is not None
        want = formula_bytes(stage, r["psi"], r["n"], mixed)
        assert {k: r["mem"][k] for k in want} == want, (stage, dtype, r["mem"], want)
        moved = sum(r["by_op"].get(op, 0) for op in ("all_gather", "reduce_scatter", "all_reduce"))
        two_psi = traffic_formula(1, r["psi"], r["n"], mixed)
        small = 64  # the loss's and the gradient norm's scalars
        if stage < 3:
            assert two_psi <= moved <= two_psi + small, (stage, dtype, r["by_op"], two_psi)
        else:
            assert r["by_op"]["reduce_scatter"] == two_psi / 2, r["by_op"]
            assert two_psi < moved <= traffic_formula(3, r["psi"], r["n"], mixed) + small, (r["by_op"], two_psi)
        if mixed:
            assert r["loss_err"] <= 1e-2, (stage, r["loss_err"])  # bf16 compute copies vs the fp32 run
        else:
            assert r["param_err"] <= 1e-6 and r["loss_err"] <= 1e-6, (stage, r["param_err"])


def test_gradient_accumulation(pool):
    """Two micro-batches: stage 1 reduce-scatters the gradients once per step (like stage 0 under
    ``defer_grad_boxing``), in one collective; stage 2 once per micro-batch in one bucket; stage 3 once
    per micro-batch and unit (each block, the rest), in the cast's backward (the last two like stage 0
    without deferral)."""
    runs = [(1, None, True), (2, None, False), (3, None, False)]
    res = pool.run(_compare, "dp2", runs, 2, 2)[0]
    assert res[0]["reduce_scatters"] == 0 and res[0]["by_op"]["all_reduce"] > 0
    for (stage, _, _), r in zip(runs, res[1:]):
        assert r["param_err"] <= 1e-6 and r["loss_err"] <= 1e-6, (stage, r["param_err"])
        assert r["reduce_scatters"] == {1: 1, 2: 2, 3: 2 * r["n_units"]}[stage], (stage, r["reduce_scatters"])


def _overlapped(stage: int):
    """Two micro-batches, the first under ``defer_grad_boxing``, 4 KiB buckets: the reduction overlaps
    backward (stage 1: the last micro-batch's; stage 2: each); master gradients vs one device."""
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(GPT_CFG)
    model = GPT2LMHeadModel(GPT_CFG)
    model.load_state_dict(ref.state_dict())
    batches = [torch.randint(0, GPT_CFG.vocab_size, (8, 16)) for _ in range(2)]
    ref_losses = []
    for x in batches:
        loss = ref(x, x)[1]
        (loss / 2).backward()
        ref_losses.append(loss.item())
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=stage, bucket_bytes=4096)
    losses = []
    with sc.comm_ledger() as ledger:
        for k, ids in enumerate(batches):
            x = sc.distribute(ids, p, (S0,))
            with sc.defer_grad_boxing() if k == 0 else contextlib.nullcontext():
                losses.append(model(x, x)[1])
                (losses[-1] / 2).backward()
        mem = held_bytes(zero)
        zero.sync_grads()
    grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
    losses = [v.full_tensor() for v in losses]
    if torch.distributed.get_rank() not in p:
        return None
    want = formula_bytes(stage, model_elements(zero), 2, False)
    return dict(grad_err=max(_rel(grads[n], q.grad) for n, q in ref.named_parameters()),
                loss_err=max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses)),
                exact=all(mem[k] == want[k] for k in ("params", "grads")),
                reduce_scatters=ledger.count("reduce_scatter"), buckets=len(zero.buckets.buckets))


def test_overlapped_reduction_matches_one_device(pool):
    for stage in (1, 2):
        for r in pool.run(_overlapped, stage)[:2]:
            assert r["grad_err"] <= 1e-5 and r["loss_err"] <= 1e-5, (stage, r)
            assert r["exact"], (stage, r)  # stage 1 keeps full-size gradients, stage 2 shards
            assert r["buckets"] > 2 and r["reduce_scatters"] == r["buckets"] * (stage == 2 and 2 or 1), (stage, r)


def _stage3_frees_gathered_weights():
    import importlib

    cast_mod = importlib.import_module("sbp_core.cast")  # the module (sbp_core.cast is also the function)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT_CFG)
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=3)
    x = sc.distribute(torch.randint(0, GPT_CFG.vocab_size, (4, 16)), p, (S0,))
    loss = model(x, x)[1]
    alive = len(cast_mod._live)  # gathered copies still referenced after forward (autograd holds handles)
    cached = sum(s.cache is not None for s in zero.slots)
    loss.backward()
    return alive, cached, all(s.master.grad is not None and s.master.grad.sbp == s.master.sbp for s in zero.slots)


def test_stage3_keeps_no_gathered_weight_between_forward_and_backward(pool):
    for alive, cached, grads_sharded in pool.run(_stage3_frees_gathered_weights):
        assert alive == 0 and cached == 0 and grads_sharded


def _dp1_warns():
    p = sc.placement("cpu", [0])
    model = GPT2LMHeadModel(GPT_CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, zero = apply_zero(model, p, {}, stage=2)
    return zero.stage, [str(w.message) for w in caught]


def _unknown_stage():
    apply_zero(GPT2LMHeadModel(GPT_CFG), sc.placement("cpu", [0, 1]), {}, stage=4)


def test_dp1_warns_and_runs_stage0(pool):
    for stage, messages in pool.run(_dp1_warns):
        assert stage == 0 and any("running as stage 0" in m for m in messages), messages


def test_unknown_stage_lists_valid_ones(pool):
    outcomes = pool.outcomes(_unknown_stage)
    assert all(not o.ok and o.exc_type == "ValueError" and "(0, 1, 2, 3)" in o.message for o in outcomes)
    with pytest.raises(ValueError, match=r"not one of \(0, 1, 2, 3\)"):
        check_stage("2", 4)
    with pytest.raises(ValueError, match="not one of"):
        check_stage(True, 4)


def test_plan_rewrite_shards_a_dim_no_other_axis_splits():
    from toolkit.zero import master_sbp, rewrite_plan

    S1 = Split(1)
    assert master_sbp((B,), (256, 64), 0, 4) == (S0,)
    assert master_sbp((B, S1), (64, 192), 0, 2) == (S0, S1)  # Megatron column-parallel weight
    assert master_sbp((B, S0), (256, 64), 0, 2) == (S1, S0)  # row-parallel / vocab-parallel: dim 1
    assert master_sbp((B, S0), (192,), 0, 2) == (S0, S0)  # every dim taken: nested, still 1/dp
    assert master_sbp((S1, B), (64, 192), 1, 2) == (S1, S0)  # dp on the second mesh axis
    assert master_sbp((B,), (2, 64), 0, 4) == (S1,)  # too few rows for 4 ranks: the next dim
    assert master_sbp((S0,), (256, 64), 0, 4) == (S0,)  # already split on dp: kept
    assert master_sbp((B,), (), 0, 4) == (B,)  # a scalar: kept
    assert rewrite_plan({"w": ((8, 4), (B, S0)), "b": ((4,), (B, B))}, 0, 2) == {"w": (S1, S0), "b": (S0, B)}


def _stage3_builds_meta_parameters_as_masters():
    from recipes.gpt2.model import GPT2Config
    from recipes.gpt2.plan import mesh_plan

    p = sc.placement("cpu", [[0], [1], [2], [3]])  # (dp 4, tp 1)
    torch.manual_seed(0)
    whole = GPT2LMHeadModel(dataclasses.replace(GPT_CFG, n_layer=2))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(dataclasses.replace(GPT_CFG, n_layer=2))
    boxes = []
    draw = model.init_shard
    model.init_shard = lambda name, box: boxes.append((name, box)) or draw(name, box)
    apply_zero(model, p, mesh_plan(), stage=3)
    if torch.distributed.get_rank() not in p:
        return None
    sizes = {n: q.numel() for n, q in whole.named_parameters()}
    too_big = [(n, box) for n, box in boxes if torch.Size(k for _, k in box).numel() > -(-sizes[n] // 4)]
    values = all(torch.equal(q.full_tensor(), dict(whole.named_parameters())[n]) for n, q in model.named_parameters())
    return too_big, values, len(boxes) == len(sizes)


def test_stage3_builds_each_meta_parameter_straight_into_its_rank_s_master_slice():
    """ZeRO-3 of a model on the meta device (the trainer builds stages so): each rank asks ``init_shard`` for its
    quarter of each parameter (the master's slice on dp 4), never the compute layout's whole tensor, and the
    masters hold the whole model's values."""
    for got in get_pool(WORLD).run(_stage3_builds_meta_parameters_as_masters)[:4]:
        assert got == ([], True, True), got


def _trainer_steps_masters_locals():
    import tempfile

    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.trainer import Job

    cfg = compose(["parallel=dp2_zero2", "model.n_layer=2", "model.n_embd=32", "model.n_head=4",
                   "model.vocab_size=512", "model.n_positions=32", "data.max_bytes=200000",
                   "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "logger=none",
                   "trainer.eval_every=0", "trainer.save_every=0", "device=cpu"], run_dir=tempfile.mkdtemp())
    job = Job(cfg, get("gpt2"))
    return sc.steps_on_locals(job.optimizer)


def test_the_trainers_zero_optimizer_steps_the_masters_locals():
    """The trainer's step syncs and refreshes ZeRO itself: no optimizer hooks, which would make every update a
    dispatched step over global tensors (on CUDA also a host read of each parameter's step count)."""
    assert get_pool(2).run(_trainer_steps_masters_locals) == [True, True]


def test_plan_rewrite_shards_a_dim_of_exactly_dp_rows():
    """A dim with exactly ``dp`` rows is "at least dp": the first such dim takes the split (one row per rank,
    an even split), not a later longer one that splits unevenly."""
    from toolkit.zero import master_sbp
    from toolkit.zero.plan import shard_dim

    S1 = Split(1)
    assert master_sbp((B,), (4, 5), 0, 4) == (S0,)  # 4 rows on 4 ranks, not 5 columns as 2, 1, 1, 1
    assert master_sbp((B, S0), (6, 2, 3), 0, 2) == (S1, S0)  # dim 0 taken: dim 1 has exactly 2
    assert shard_dim((B,), (3, 3, 7), 0, 3) == 0


def _prefetch_counts():
    """Stage 3, dp2, 4 blocks, two steps: all-gathers started, blocks whose weights are gathered or on
    their way, reduce-scatters started and blocks whose gradients landed, when each block's forward
    begins, when its MLP's begins, and when backward reaches each block's output and its attention's."""
    cfg = dataclasses.replace(GPT_CFG, n_layer=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=3)
    events, ledger = [], {}
    blocks = [next(u for u in zero.units if u.name == f"transformer.h.{i}") for i in range(cfg.n_layer)]

    def seen(kind, i):
        if kind.startswith("forward"):  # blocks' units gathered or on their way
            busy = sum(u.gathered() or u.started is not None for u in zero.units if u.name)
        else:  # blocks' rebuilt or rebuilding remat groups (the root's, freed last, is the last group)
            busy = sum(g.cache is not None or g.started is not None for g in zero._freed[:-1])
        landed = [j for j, u in enumerate(blocks) if all(sl.leaf.grad is not None for sl in u.slots)]
        events.append((kind, i, ledger["now"].count("all_gather"), busy, ledger["now"].count("reduce_scatter"), landed))

    def at_output(out, kind, i):
        out.register_hook(lambda g: seen(kind, i))

    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda m, a, i=i: seen("forward", i))
        block.mlp.register_forward_pre_hook(lambda m, a, i=i: seen("forward mlp", i))
        block.register_forward_hook(lambda m, a, o, i=i: at_output(o, "backward", i))
        block.attn.register_forward_hook(lambda m, a, o, i=i: at_output(o, "backward attn", i))
    steps = []
    for _ in range(2):
        events.clear()
        model.zero_grad(set_to_none=True)
        x = sc.distribute(torch.randint(0, cfg.vocab_size, (4, 16)), p, (S0,))
        with sc.comm_ledger() as ledger["now"]:
            model(x, x)[1].backward()
        steps.append((list(events), ledger["now"].count("all_gather")))
    return steps, cfg.n_layer


def test_stage3_starts_each_units_gather_while_the_unit_before_computes(pool):
    """Forward: the root's gather starts block 0's and block i's starts block i+1's (so when block i's
    forward begins, i + 2 gathers have started, and while it computes, blocks i and i+1 hold or fetch
    their weights). Backward rebuilds the root first (the LM head's tied weight), then the blocks from
    the last, and each rebuild starts the next one's. No gather more than without prefetch. Block i+1's
    gradient reduce-scatter is in flight while block i's backward computes: its gradients land when
    block i's reduce-scatter starts (the rest when backward ends: ``_stage3_frees_gathered_weights``)."""
    for steps, n in pool.run(_prefetch_counts)[:2]:
        for events, total in steps:
            assert total == 2 * (n + 1), total  # forward and backward gather each unit once
            fwd = n + 1
            want = []
            for i in range(n):
                want += [("forward", i, i + 2, 1, 0, []), ("forward mlp", i, min(i + 3, n + 1), 1 + (i < n - 1), 0, [])]
            for i in reversed(range(n)):
                # blocks i+1.. have started their reduce-scatters; block i+1's is in flight while block i computes
                rs, landed = n - 1 - i, list(range(i + 2, n))
                want += [("backward", i, fwd + 1 + n - i, 1, rs, landed),
                         ("backward attn", i, fwd + 1 + min(n - i + 1, n), 1 + (i > 0), rs, landed)]
            assert events == want, events


class _Blocks(torch.nn.Module):
    """Blocks run in the order each call names (a block twice, or skipped): forward orders that change."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=dtype) for _ in range(4))
        self.head = torch.nn.Linear(8, 2, dtype=dtype)

    def forward(self, x, order):
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x).square().mean()


ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (3, 2, 1, 0), (0, 1, 1, 3), (0, 1, 2, 3)]


def _changing_orders():
    """Stage 3 on dp2 through forwards whose unit order changes from step to step (prefetch guesses wrong),
    against one device training on its own: losses and parameters after each step, and what stays gathered."""
    import importlib

    cast_mod = importlib.import_module("sbp_core.cast")
    torch.manual_seed(0)
    ref = _Blocks()
    model = _Blocks()
    model.load_state_dict(ref.state_dict())
    xs = [torch.randn(6, 8, dtype=torch.float64) for _ in ORDERS]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=3)
    opt = zero.optimizer(torch.optim.AdamW, lr=1e-2)
    worst, left = 0.0, []
    for x, order in zip(xs, ORDERS):
        want = ref(x, order)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = model(sc.distribute(x, p, (S0,)), order)
        left.append(sum(u.gathered() or u.started is not None for u in zero.units))
        got.backward()
        left.append(len(cast_mod._live))
        worst = _step_and_compare(zero, opt, model, got, ref, want, p, worst)
    return worst, left


def test_stage3_prefetch_follows_forwards_whose_order_changes(pool):
    for worst, left in pool.run(_changing_orders)[:2]:
        assert worst <= 1e-9, worst
        assert left == [0] * len(left), left  # nothing gathered after forward, nothing kept after backward


def _checkpointed(reentrant: bool, steps: int = 2):
    """Stage 3, dp2, 4 blocks each under activation checkpointing (the recipe's wrapping, or a reentrant
    checkpoint, whose recomputed graph is differentiated), float64, against one device training on its
    own: the worst relative error of losses and parameters, the all-gathers each backward started, and per
    block whose forward backward recomputes, the all-gathers started when that recompute reaches its MLP.
    Each step first runs a forward whose output is kept and never differentiated."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    cfg = dataclasses.replace(GPT_CFG, n_layer=4)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg).double()
    model = GPT2LMHeadModel(cfg).double()
    model.load_state_dict(ref.state_dict())
    for block in model.transformer.h:
        block.forward = partial(checkpoint, block.forward, use_reentrant=reentrant)
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = zero.optimizer(torch.optim.SGD, lr=0.1)
    ledger, seen, kept = {}, [], []
    for i, block in enumerate(model.transformer.h):
        block.mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, ledger["now"].count("all_gather")))
            if torch._C._current_graph_task_id() != -1 else None)
    worst, backward = 0.0, []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (4, 16))
        want = ref(x, x)[1]
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xg = sc.distribute(x, p, (S0,))
        kept.append(model(xg, xg)[1])  # a forward whose graph stays, never differentiated
        got = model(xg, xg)[1]
        seen.clear()
        with sc.comm_ledger() as ledger["now"]:
            got.backward()
        backward.append((ledger["now"].count("all_gather"), list(seen)))
        worst = _step_and_compare(zero, opt, model, got, ref, want, p, worst)
    return worst, backward, cfg.n_layer


@pytest.mark.parametrize("reentrant", [False, True])
def test_stage3_under_activation_checkpointing_gathers_each_recomputed_unit_once(pool, reentrant):
    """A recomputed block reads its weights outside the module's forward: its unit is gathered for the
    recompute in one collective (not one per parameter), from the second step on started while the block
    after it recomputes (the first step learns which units backward recomputes)."""
    for worst, backward, n in pool.run(_checkpointed, reentrant)[:2]:
        assert worst <= 1e-9, worst
        for step, (gathers, seen) in enumerate(backward):
            assert gathers == n + 1, gathers  # the root's (the tied head) and each block's, once
            # at block i's recomputed MLP: the root's, blocks n-1..i, and from step 2 block i-1's prefetch
            assert seen == [(i, 1 + n - i + (step > 0 and i > 0)) for i in reversed(range(n))], (step, seen)


def _after_a_failed_backward(stage: int):
    """dp2, fp32, 4 blocks: a backward that raises midway (stage 3: two units' gradients landed, one
    reduce-scatter in flight; stage 2: buckets started, none ended), ``zero.zero_grad()``, then a whole
    step; against one device taking that step alone."""
    cfg = dataclasses.replace(GPT_CFG, n_layer=4)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    model = GPT2LMHeadModel(cfg)
    model.load_state_dict(ref.state_dict())
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=stage, bucket_bytes=4096)
    opt = zero.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    bad, good = (torch.randint(0, cfg.vocab_size, (4, 16)) for _ in range(2))

    def fail(grad):
        raise ValueError("a backward that raises")

    xb = sc.distribute(bad, p, (S0,))
    hook = model.transformer.h[1].register_forward_hook(lambda m, a, out: out.register_hook(fail) and None)
    loss = model(xb, xb)[1]
    hook.remove()
    try:
        loss.backward()
    except ValueError:
        pass
    del loss
    landed = sum(sl.leaf.grad is not None or sl.master.grad is not None for sl in zero.slots)
    zero.zero_grad()
    xg = sc.distribute(good, p, (S0,))
    with sc.comm_ledger() as ledger:
        model(xg, xg)[1].backward()
        zero.sync_grads()
    opt.step()
    ref(good, good)[1].backward()
    ref_opt.step()
    params = [q.full_tensor() for q in model.parameters()]
    if torch.distributed.get_rank() not in p:
        return None
    buckets = len(zero.buckets.buckets) if zero.buckets is not None else None
    return landed, max(_rel(q, r) for q, r in zip(params, ref.parameters())), ledger.count("reduce_scatter"), buckets


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_drops_what_a_failed_backward_left(pool, stage):
    """... and the next backward reduces as any: stage 2 in its buckets during backward (one reduce-scatter
    each), stage 3 per unit."""
    for landed, worst, reduce_scatters, buckets in pool.run(_after_a_failed_backward, stage)[:2]:
        assert landed > 0 and worst <= 1e-5, (landed, worst)
        if stage == 2:
            assert buckets > 2 and reduce_scatters == buckets, (reduce_scatters, buckets)


def _stage3_on_dp2(cls):
    """``cls()`` built from seed 0, under ZeRO-3 on ranks 0 and 1: ``(model, zero, placement)``."""
    torch.manual_seed(0)
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(cls(), p, {}, stage=3)
    return model, zero, p


class _ExpertBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(8, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        x = torch.tanh(self.mix(x))
        return sum(torch.tanh(e(x)) for e in self.experts)


class _ExpertBlocks(torch.nn.Module):
    """Blocks of a linear and a ModuleList of experts: units nested in units (each block, each expert),
    whose forwards end in an order backward does not rebuild them in (a block's forward ends after its
    experts', but backward needs the experts' weights first); the first linear's weight is not saved (its
    input needs no gradient), so its group is never rebuilt."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ExpertBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _nested_units():
    model, zero, p = _stage3_on_dp2(_ExpertBlocks)
    out = []
    for _ in range(2):
        loss = model(sc.distribute(torch.randn(6, 8), p, (S0,)))
        saved = sum(g.saved for g in zero._freed)
        with sc.comm_ledger() as ledger:
            loss.backward()
        out.append((ledger.count("all_gather"), saved, sum(g.started is not None for g in zero._freed)))
    return out, len(zero.units)


def test_stage3_backward_prefetches_only_groups_backward_will_rebuild(pool):
    """Backward gathers each group whose weights an op saved once, and no other (no prefetch of a group
    already released or never rebuilt), and leaves no gather in flight."""
    for steps, n_units in pool.run(_nested_units)[:2]:
        for gathers, saved, in_flight in steps:
            assert 0 < saved < n_units and gathers == saved and in_flight == 0, (gathers, saved, in_flight)


class _PairCheckpointed(torch.nn.Module):
    """Four linear blocks (a unit each) under two checkpoints of two blocks each, and a head (the root's):
    a recompute reads two units, the first of each pair without prefetch."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(4))
        self.head = torch.nn.Linear(8, 2, dtype=torch.float64)

    def _pair(self, x, i):
        return torch.tanh(self.blocks[i + 1](torch.tanh(self.blocks[i](x))))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i in (0, 2):
            x = checkpoint(self._pair, x, i, use_reentrant=False)
        return self.head(x).square().mean()


def _pair_checkpointed():
    torch.manual_seed(0)
    ref = _PairCheckpointed()
    model = _PairCheckpointed()
    model.load_state_dict(ref.state_dict())
    p = sc.placement("cpu", [0, 1])
    model, zero = apply_zero(model, p, {}, stage=3)
    opt = zero.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out, worst = [], 0.0
    for _ in range(3):
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        want = ref(x)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(sc.distribute(x.detach().requires_grad_(), p, (S0,)))
        with sc.comm_ledger() as ledger:
            loss.backward()
        left = sum(u.ahead is not None or u.copies is not None for u in zero.units)
        out.append((ledger.count("all_gather"), left))
        worst = _step_and_compare(zero, opt, model, loss, ref, want, p, worst)
    return worst, out, len(zero.units)


def test_stage3_recompute_of_several_units_prefetches_none_twice(pool):
    """A checkpoint spanning two units: each unit is gathered once per backward (a unit recomputed already
    is not prefetched again), nothing is left gathered after backward, and the values are one device's."""
    for worst, steps, n_units in pool.run(_pair_checkpointed)[:2]:
        assert worst <= 1e-9, worst
        assert steps == [(n_units, 0)] * 3, (steps, n_units)


class _TwoChunks(torch.nn.Module):
    """A rank's two interleaved pipeline stages as one module: forwards alternate between the blocks 0-1 and
    2-3, so consecutive forwards begin at different units."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, chunk):
        for block in self.blocks[2 * chunk:2 * chunk + 2]:
            x = torch.tanh(block(x))
        return x


def _alternating_chunks():
    model, zero, p = _stage3_on_dp2(_TwoChunks)
    ledger, seen = {}, []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, ledger["now"].count("all_gather"))))
    out = []
    for chunk in (0, 1, 0, 1):
        seen.clear()
        with sc.comm_ledger() as ledger["now"]:
            model(sc.distribute(torch.randn(6, 8), p, (S0,)), chunk).square().mean().backward()
        out.append(list(seen))
    return out


def test_stage3_prefetches_in_forwards_that_begin_at_different_units(pool):
    """Each chunk's forward follows the order of that chunk's last forward: when its second block begins,
    that block's gather started with the first's (chunk 0's first forward too, by the modules' order;
    chunk 1's from its second forward). A block's gather starts when it first reads a weight."""
    for steps in pool.run(_alternating_chunks)[:2]:
        assert steps == [[(0, 0), (1, 2)], [(2, 0), (3, 1)], [(0, 0), (1, 2)], [(2, 0), (3, 2)]], steps


class _CheckpointedBlocks(torch.nn.Module):
    """Four linear blocks, each under its own checkpoint; a forward runs the blocks it is given."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, which):
        from torch.utils.checkpoint import checkpoint

        for i in which:
            x = checkpoint(lambda t, i=i: torch.tanh(self.blocks[i](t)), x, use_reentrant=False)
        return x.square().mean()


def _chunk_after_a_full_forward():
    model, zero, p = _stage3_on_dp2(_CheckpointedBlocks)
    out = []
    for which in ((0, 1, 2, 3), (2, 3), (2, 3)):
        x = sc.distribute(torch.randn(6, 8), p, (S0,)).requires_grad_()
        loss = model(x, which)
        with sc.comm_ledger() as ledger:
            loss.backward()
        out.append(ledger.count("all_gather"))
        zero.zero_grad()
    return out


def test_stage3_recompute_prefetch_follows_the_last_forward_that_ran_the_unit(pool):
    """After a forward of every block, a forward of blocks 2-3 recomputes only those in backward: two
    gathers, no prefetch of block 1 (which the full forward ran before block 2)."""
    for gathers in pool.run(_chunk_after_a_full_forward)[:2]:
        assert gathers == [4, 2, 2], gathers
