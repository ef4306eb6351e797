"""InsightFace's plan trains exactly like one device; Partial FC samples and updates as PFC v2 says.

- A tiny iResNet + ArcFace head (10 classes: uneven shards), float64, SGD with
  momentum and weight decay, 3 steps on dp2, dp4 and dp2 x tp2 meshes with
  the recipe's plan (batch ``S(0)`` over all ranks, FC ``S(0)`` over classes
  on every axis): loss, every gradient, every parameter and batch-norm
  statistic after each step equal the single-device run, which trains on its
  own, to 1e-7 (relative to the tensor's largest magnitude; measured at most
  7.1e-9, in the gradients of biases that feed a batch norm, whose terms
  cancel to ~1e-8 of their size; a tensor whose largest magnitude is below
  1e-6, a gradient that is zero up to rounding, is held to 1e-13 absolute).
- The head's traffic on dp2 x tp2 with 4000 classes: no collective moves
  logits; every one is at most the ``[N, E]`` embeddings.
- Partial FC (sample_rate 0.3, CosFace) on dp2 x tp2: each shard keeps its
  positives and ``int(0.3 * rows)`` centres; the loss and the FC gradient
  equal a single-device head restricted to the sampled classes; after the
  optimizer step un-sampled rows and their momentum are untouched and
  sampled ones moved; the same seed draws the same sample.
"""
from __future__ import annotations

import copy

import pytest
import torch

import sbp_core as sc
from recipes.insightface import partial_fc
from recipes.insightface.head import MarginSoftmaxHead
from recipes.insightface.iresnet import IResNet
from recipes.insightface.margin import CombinedMargin
from recipes.insightface.model import FaceModel
from recipes.insightface.optim import PartialFCSGD
from recipes.insightface.plan import DATA_SBP, PLAN
from sbp_core.sbp import Broadcast, Split
from toolkit.rank_pool import get_pool

WORLD = 5
MESHES = {"dp2": [[0], [1]], "dp4": [[0], [1], [2], [3]], "dp2_tp2": [[0, 1], [2, 3]]}
CLASSES, EMB, N, STEPS = 10, 8, 8, 3
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)
B, S0 = Broadcast(), Split(0)


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def _full(t):
    return t.full_tensor() if isinstance(t, sc.GlobalTensor) else t


def _optimizer(model):
    return PartialFCSGD(model.parameters(), {model.head.weight: model.head.sampled_rows}, **SGD)


def _train(mesh: str):
    """Members return ``{what: worst relative error over the steps}``."""
    p = sc.placement("cpu", MESHES[mesh])
    torch.manual_seed(0)
    ref = FaceModel(IResNet((1, 1, 1, 1), width=4, image_size=16, embedding_size=EMB),
                    MarginSoftmaxHead(CLASSES, EMB, CombinedMargin.named("arcface"))).double()
    model = sc.distribute_module(copy.deepcopy(ref), p, PLAN)
    opt_ref, opt = _optimizer(ref), _optimizer(model)
    gen = torch.Generator().manual_seed(1)
    worst: dict = {}
    member = torch.distributed.get_rank() in p

    def note(key, err):
        worst[key] = max(worst.get(key, 0.0), err)

    for _ in range(STEPS):
        x = torch.randn(N, 3, 16, 16, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (N,), generator=gen)
        loss_ref = ref(x, y)
        loss_ref.backward()
        loss = model(sc.distribute(x, p, DATA_SBP), sc.distribute(y, p, DATA_SBP))
        loss.backward()
        full = _full(loss.detach())
        if member:
            note("loss", abs(float(full) - loss_ref.item()) / abs(loss_ref.item()))
        for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
            if b.grad is not None:
                g = _full(a.grad)
                if member:
                    note(f"grad {name}", _rel(g, b.grad))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
            if b.is_floating_point():
                v = _full(a)
                if member:
                    note(name, _rel(v, b))
    return worst if member else None


def test_plan_matches_one_device_for_three_sgd_steps():
    pool = get_pool(WORLD)
    bad = []
    for mesh in MESHES:
        for rank, worst in enumerate(pool.run(_train, mesh)):
            for key, err in (worst or {}).items():
                if not err <= 1e-7:  # float64; BatchNorm bias gradients cancel to ~1e-8 of their terms
                    bad.append(f"{mesh} rank {rank} {key}: {err:.2e}")
    assert not bad, "\n".join(bad)


def _head_traffic(classes: int):
    p = sc.placement("cpu", MESHES["dp2_tp2"])
    torch.manual_seed(0)
    head = sc.distribute_module(MarginSoftmaxHead(classes, EMB, CombinedMargin.named("arcface")), p,
                                {k[5:]: v for k, v in PLAN.items() if k.startswith("head.")})
    emb = sc.distribute(torch.randn(N, EMB), p, DATA_SBP, requires_grad=True)
    y = sc.distribute(torch.randint(0, classes, (N,)), p, DATA_SBP)
    with sc.comm_ledger() as ledger:
        loss = head(emb.to_global(sbp=(B, B)), y.to_global(sbp=(B, B)))
        loss.backward()
    if torch.distributed.get_rank() not in p:
        return None
    return [(r.op, r.bytes) for r in ledger.records], head.weight.grad.sbp, loss.sbp


def test_head_communicates_embeddings_and_row_statistics_never_logits():
    classes = 4000
    for rank, out in enumerate(get_pool(WORLD).run(_head_traffic, classes)):
        if out is None:
            continue
        records, grad_sbp, loss_sbp = out
        assert grad_sbp == (S0, S0), grad_sbp  # the FC gradient stays class-split: no traffic
        emb_bytes = N * EMB * 4
        assert records and max(b for _, b in records) <= emb_bytes, records
        assert sum(b for _, b in records) < N * classes * 4 / 20, records


PFC_CLASSES, PFC_RATE = 23, 0.3


def _partial_fc(on_locals: bool):
    """dp2 x tp2 members return ``{check: problem or None}``; rank 4 (outside) returns None.

    ``on_locals``: the trainer's ``sc.step_on_locals`` steps the optimizer, else its own dispatched step."""
    p = sc.placement("cpu", MESHES["dp2_tp2"])
    if torch.distributed.get_rank() not in p:
        return None  # sampling needs the labels, which only the placement's ranks hold
    torch.manual_seed(0)
    head = sc.distribute_module(
        MarginSoftmaxHead(PFC_CLASSES, EMB, CombinedMargin.named("cosface"), sample_rate=PFC_RATE).double(), p,
        {k[5:]: v for k, v in PLAN.items() if k.startswith("head.")})
    opt = PartialFCSGD(head.parameters(), {head.weight: head.sampled_rows}, **SGD)
    gen = torch.Generator().manual_seed(2)
    out, before = {}, None
    for step in range(2):
        e = torch.randn(N, EMB, generator=gen, dtype=torch.float64)
        y = torch.randint(0, PFC_CLASSES, (N,), generator=gen)
        emb = sc.distribute(e, p, (B, B), requires_grad=True)
        labels = sc.distribute(y, p, (B, B))
        w_full = head.weight.full_tensor().detach()
        draw = int(head.draws.to_local())
        loss = head(emb, labels)
        loss.backward()
        _, ids, rows, in_sample = partial_fc.sample(head.weight, head.class_ids, labels, PFC_RATE, head.seed,
                                                    draw)
        ids = ids.full_tensor()
        kept = ids[ids >= 0]
        ranges, _ = partial_fc.shards_of(head.weight)
        counts = [int(((kept >= a) & (kept < a + n)).sum()) for a, n in ranges]
        want = _pfc_counts(ranges, torch.unique(y), PFC_RATE)
        out[f"counts {step}"] = None if counts == want else f"{counts} != {want}"
        out[f"positives {step}"] = None if bool(torch.isin(y, kept).all()) else f"labels {y} not all in {kept}"
        # Single device over the sampled classes only.
        ref_w = w_full[kept].clone().requires_grad_()
        ref_e = e.clone().requires_grad_()
        ref_head = MarginSoftmaxHead(len(kept), EMB, CombinedMargin.named("cosface")).double()
        ref_head.weight = torch.nn.Parameter(ref_w)
        ref_loss = ref_head(ref_e, torch.searchsorted(kept, y))
        ref_loss.backward()
        grad = head.weight.grad.full_tensor()
        errs = [abs(float(loss.detach().full_tensor()) - ref_loss.item()) / ref_loss.item(),
                _rel(grad[kept], ref_head.weight.grad), _rel(emb.grad.full_tensor(), ref_e.grad)]
        unsampled = torch.ones(PFC_CLASSES, dtype=torch.bool)
        unsampled[kept] = False
        out[f"parity {step}"] = None if max(errs) <= 1e-5 and grad[unsampled].abs().max() == 0 else f"{errs}"
        used = head._touched[0].nonzero().flatten()  # the rows this forward sampled
        again = rows[in_sample]  # the same draw, repeated
        out[f"deterministic {step}"] = None if torch.equal(used, again) else f"{used} != {again}"
        sc.step_on_locals(opt) if on_locals else opt.step()
        opt.zero_grad()
        w_now = head.weight.full_tensor()
        buf = opt.state[head.weight]["momentum_buffer"].full_tensor()
        if before is not None:
            w0, b0 = before
            moved = (w_now != w0).any(1) & (buf != b0).any(1)
            out["untouched"] = None if (w_now[unsampled] == w0[unsampled]).all() and (
                buf[unsampled] == b0[unsampled]).all() else "un-sampled rows changed"
            out["moved"] = None if moved[kept].all() else f"sampled rows {kept[~moved[kept]]} did not move"
        before = (w_now.clone(), buf.clone())
    return out


@pytest.mark.parametrize("on_locals", [False, True], ids=["dispatched", "on_locals"])
def test_partial_fc_samples_positives_and_updates_only_sampled_rows(on_locals):
    bad = [f"rank {r} {k}: {v}" for r, out in enumerate(get_pool(WORLD).run(_partial_fc, on_locals)) if out
           for k, v in out.items() if v is not None]
    assert not bad, "\n".join(bad)


def _pfc_counts(ranges, classes: torch.Tensor, sample_rate: float) -> list:
    """PFC v2's sample size per shard: ``max(int(sample_rate * rows), classes in its range)``."""
    return [max(int(sample_rate * n), int(((classes >= a) & (classes < a + n)).sum())) for a, n in ranges]


@pytest.mark.parametrize("labels,rate,want", [
    ([0, 1, 2, 3, 4, 8], 0.25, [[0, 1, 2, 3], [0], [0]]),
    ([4, 5, 6, 7, 8, 9], 0.5, [None, [0, 1, 2, 3], [0, 1]]),
])
def test_a_shard_keeps_the_labels_in_its_range_only(labels, rate, want):
    """12 classes in shards of ``[a, a + 4)``: class ``a + 4`` is the next shard's positive. Written-out rows
    each shard keeps (``None``: two negatives, no positive); every shard gathers all 4 rows (6 labels)."""
    labels = torch.tensor(labels)
    for shard, start in enumerate((0, 4, 8)):
        width = partial_fc.gathered(4, len(labels), rate)
        rows, kept = partial_fc.draw(4, labels, start, width, int(rate * 4), seed=shard, draws=torch.tensor(3))
        assert rows.tolist() == [0, 1, 2, 3]
        got = rows[kept].tolist()
        assert got == want[shard] if want[shard] is not None else len(got) == 2, (shard, got)


def test_the_draw_is_uniform_and_a_function_of_seed_and_counter():
    """Over 2000 draws of 5 negatives from 50 rows every row is drawn 200 +- 25% times (the hash's order is
    uniform enough; the binomial's sd is 13.4); a draw repeats with its (seed, counter) and changes with each."""
    n, num, runs = 50, 5, 2000
    none = torch.tensor([-1])
    seen = torch.zeros(n)
    for c in range(runs):
        rows, kept = partial_fc.draw(n, none, 0, num, num, seed=11, draws=torch.tensor(c))
        seen[rows[kept]] += 1
    assert seen.sum() == runs * num and seen.min() >= 150 and seen.max() <= 250, seen
    first = partial_fc.draw(n, none, 0, num, num, seed=11, draws=torch.tensor(7))[0]
    assert torch.equal(first, partial_fc.draw(n, none, 0, num, num, seed=11, draws=torch.tensor(7))[0])
    assert not torch.equal(first, partial_fc.draw(n, none, 0, num, num, seed=11, draws=torch.tensor(8))[0])
    assert not torch.equal(first, partial_fc.draw(n, none, 0, num, num, seed=12, draws=torch.tensor(7))[0])


def test_more_labels_than_the_sample_gather_masked_rows():
    """One shard of 20 rows, rate 0.1 (2 centres), 6 labels of 3 classes: 6 rows gathered, the 3 positives
    kept (more than 2: all of them), the other 3 rows gathered but outside the sample (class id -1)."""
    w, ids = torch.randn(20, 4), torch.arange(20)
    labels = torch.tensor([3, 3, 17, 9, 17, 9])
    sw, sids, rows, kept = partial_fc.sample(w, ids, labels, 0.1, seed=5, draws=0)
    assert sw.shape == (6, 4) and rows.tolist() == sorted(rows.tolist())
    assert sorted(sids[sids >= 0].tolist()) == [3, 9, 17] and int((sids < 0).sum()) == 3
    assert torch.equal(sw, w[rows]) and torch.equal(rows[kept], torch.tensor([3, 9, 17]))


def _shard_samples():
    """dp4 (FC rows in 4 shards of 40), every label in shard 0: each member returns its sampled local rows."""
    p = sc.placement("cpu", MESHES["dp4"])
    if torch.distributed.get_rank() not in p:
        return None
    w = sc.distribute(torch.randn(160, EMB, generator=torch.Generator().manual_seed(0)), p, (S0, S0))
    ids = sc.distribute(torch.arange(160), p, (S0, S0))
    labels = sc.distribute(torch.tensor([0, 1, 0, 2]), p, (B, B))
    _, _, rows, kept = partial_fc.sample(w, ids, labels, 0.25, seed=7, draws=3)
    return rows[kept].tolist()


def test_partial_fc_shards_draw_their_own_negatives():
    """The negatives' generator is seeded by (seed, draw, shard): shards with no positives, the same size and
    the same count draw different rows (PFC v2 samples each shard's centres on its own)."""
    got = [r for r in get_pool(WORLD).run(_shard_samples) if r is not None]
    assert len(got) == 4 and all(len(r) == 10 for r in got), got
    assert {0, 1, 2} <= set(got[0]), got[0]
    assert len({tuple(r) for r in got[1:]}) == 3, got


def test_partial_fc_sgd_is_sgd_with_weight_decay_on_the_sampled_rows():
    """On one device, the sampled rows take ``torch.optim.SGD``'s step (momentum and weight decay), run on
    those rows alone, once each though reported twice; the other rows, gathered or not, and their momentum
    stay as they were."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3, generator=gen))
    rows = torch.tensor([1, 4])
    gathered = torch.tensor([4, 0, 1, 4, 5])  # as two forwards report them: 0 and 5 gathered, not sampled
    sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.5)
    opt = PartialFCSGD([w], {w: lambda: (gathered, torch.isin(gathered, rows))}, **sgd)
    ref = torch.nn.Parameter(w.detach()[rows].clone())
    opt_ref = torch.optim.SGD([ref], **sgd)
    start = w.detach().clone()
    for _ in range(3):
        g = torch.randn(6, 3, generator=gen)
        w.grad, ref.grad = g.clone(), g[rows].clone()
        opt.step()
        opt_ref.step()
    torch.testing.assert_close(w.detach()[rows], ref.detach(), rtol=1e-6, atol=1e-7)
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(w.detach()[others], start[others])
    assert torch.equal(opt.state[w]["momentum_buffer"][others], torch.zeros(4, 3))


def test_a_skipped_steps_sample_does_not_move_in_the_next_step():
    """fp16's overflow skips a step (its gradients dropped by ``zero_grad``, no ``step``): the rows only that
    step sampled keep their values and momentum through the next step, which trains its own sample only."""
    torch.manual_seed(0)
    head = MarginSoftmaxHead(60, EMB, CombinedMargin.named("arcface"), sample_rate=0.1)
    opt = PartialFCSGD(head.parameters(), {head.weight: head.sampled_rows}, **SGD)
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(4, EMB, generator=gen)

    def forward(labels):  # the rows this forward keeps: its draw, repeated
        _, _, rows, kept = partial_fc.sample(head.weight, head.class_ids, labels, 0.1, head.seed, head.draws)
        head(emb, labels).backward()
        return set(rows[kept].tolist())

    skipped = forward(torch.tensor([1, 2, 3, 4]))
    opt.zero_grad()  # the skipped step
    before = head.weight.detach().clone()
    trained = forward(torch.tensor([40, 41, 42, 43]))
    opt.step()
    only_skipped = sorted(skipped - trained)
    moved = (head.weight.detach() != before).any(1)
    assert only_skipped and not moved[only_skipped].any(), (only_skipped, moved.nonzero().flatten())
    assert moved[sorted(trained)].all()
