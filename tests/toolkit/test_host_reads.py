"""On one device our step reads nothing on the host that a plain PyTorch loop's step does not.

On a GPU an op whose result the host needs (``.item()``, ``float(t)``,
``bool(t)``, ``nonzero``, boolean-mask indexing, ``unique``, sparse
``coalesce``, ...) makes the host wait for every kernel queued before it,
so a step that issues one cannot run ahead of the device. Such ops look the
same on CPU, where a ``TorchDispatchMode`` on the stepping thread counts
them: on a CPU host the runtime runs the whole step there, data actors
included. Each recipe's ``toolkit.trainer.Job`` steps against
``toolkit.plain_loop.PlainLoop`` on the same config, both reading their
batches in the step; ours must issue no more of any such op than the plain
loop does. The plain loop's own count is not zero on CPU: torch's
non-fused optimizers read their CPU step counters, and the data sources
index on the host (on a GPU both stay on the host: no wait). Copies to the
CPU (``.cpu()``, ``.tolist()``) are invisible here, where every tensor
already is on the CPU.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from toolkit.rank_pool import get_pool

from .host_reads import HostReads

COMMON = ["logger=none", "trainer.eval_every=0", "trainer.save_every=0", "trainer.max_steps=4", "device=cpu"]
CASES = {
    "gpt2": ["recipe=gpt2", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.vocab_size=512",
             "model.n_positions=32", "data.max_bytes=200000", "trainer.micro_batch_size=4",
             "trainer.global_batch_size=8", "model.dropout=0.0", "trainer.precision=bf16", "trainer.grad_clip=1.0"],
    "insightface": ["recipe=insightface", "trainer.micro_batch_size=8", "trainer.global_batch_size=8",
                    "data.synthetic.images_per_identity=4"],
    "wide_deep": ["recipe=wide_deep", "model=wide-deep-tiny", "trainer.micro_batch_size=256",
                  "trainer.global_batch_size=256", "data.train_rows=5000", "data.val_rows=100"],
}


def _count(step, steps) -> HostReads:
    step(0)  # first-step work (state, caches) is not the steady state
    with HostReads() as reads:
        for i in steps:
            step(i)
    return reads


def _ours_and_plain(overrides):
    """Worker (rank 0 of a 1-rank pool): ``(ours, plain)`` host-reading ops, ``(ops, sites)`` each, over 2 steps."""
    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.plain_loop import PlainLoop
    from toolkit.trainer import Job

    cfg = compose([*overrides, *COMMON], run_dir=tempfile.mkdtemp())
    recipe = get(cfg.recipe.name)
    ours = _count(Job(cfg, recipe).pipe.step, range(1, 3))
    plain = _count(PlainLoop(cfg, recipe, "cpu").step, range(1, 3))
    return (ours.ops, ours.sites), (plain.ops, plain.sites)


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_our_step_reads_on_the_host_no_more_than_the_plain_loops(recipe):
    (ours, our_sites), (plain, plain_sites) = get_pool(1).run(_ours_and_plain, CASES[recipe])[0]
    extra = ours - plain
    assert not extra, f"ours reads {dict(extra)} more; ours {dict(our_sites)}, plain {dict(plain_sites)}"


def test_the_probe_sees_an_item_a_mask_and_a_coalesce():
    x = torch.arange(6.0)
    with HostReads() as reads:
        float(x.sum())
        x[x > 2] = 0.0
        torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.ones(2), (3,), check_invariants=True).coalesce()
        x.repeat_interleave(torch.tensor([1, 1, 1, 1, 1, 2]))
    assert reads.ops["aten::_local_scalar_dense"] == 1 and reads.ops["aten::_coalesce"] == 1
    assert reads.ops["aten::index_put_"] == 1 and reads.ops["aten::repeat_interleave"] == 1, reads.ops
    assert any("test_host_reads.py" in s for s in reads.sites)


def test_a_partial_fc_step_reads_nothing_on_the_host():
    """Partial FC's class draw, its masked head and ``PartialFCSGD``'s masked row step stay on the device: a
    step (forward, backward, SGD with momentum and weight decay) issues none of the ops above."""
    from recipes.insightface.head import MarginSoftmaxHead
    from recipes.insightface.margin import CombinedMargin
    from recipes.insightface.optim import PartialFCSGD

    torch.manual_seed(0)
    head = MarginSoftmaxHead(50, 8, CombinedMargin.named("arcface"), sample_rate=0.2)
    opt = PartialFCSGD(head.parameters(), {head.weight: head.sampled_rows}, lr=0.1, momentum=0.9,
                       weight_decay=5e-4)
    emb, labels = torch.randn(16, 8), torch.randint(0, 50, (16,))

    def step(_):
        head(emb, labels).backward()
        opt.step()
        opt.zero_grad()

    reads = _count(step, range(1, 3))
    assert not reads.ops, dict(reads.sites)
