"""``PipelineStep.infer``: the last stage's output of each piece, forward only, equals one device's model.

GPT-2 tiny (4 layers of 64, fp32, dropout 0) on tp2_pp2, at its initial
weights (every layout builds the same ones from the seed): three pieces of
a micro-batch's token ids through both stages; rank 0 gets each piece's
whole logits, equal to the plain model's (``toolkit.plain_loop.PlainLoop``
built on one device) within 1e-5 of their largest magnitude, in piece
order. Under tp the first stage's output is a partial sum until it takes
the boundary's layout; a piece that crossed as one rank's partial comes out
off by about 1.
"""
from __future__ import annotations

import tempfile

import torch
from omegaconf import OmegaConf

from toolkit.config import compose, validate
from toolkit.rank_pool import get_pool

TINY = ["recipe=gpt2", "model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512",
        "model.n_positions=64", "data.max_bytes=300000", "trainer.global_batch_size=16",
        "trainer.micro_batch_size=4", "model.dropout=0.0", "trainer.eval_every=0", "logger=none"]
PIECES = 3


def _tokens(shape):
    return torch.randint(0, 512, (PIECES, *shape), generator=torch.Generator().manual_seed(0))


def _rank_infer(container: dict):
    """Rank 0: the pieces' logits (a list); other ranks ``None``."""
    from recipes.registry import get
    from sbp_core.layout import local_box
    from sbp_core.process_groups import world_rank
    from toolkit.trainer import Job

    cfg = OmegaConf.create(container)
    recipe = get(cfg.recipe.name)
    job = Job(cfg, recipe)
    shape, _ = job.pipe.cfg.batch["input_ids"]
    tokens, placement = _tokens(shape), job.placements[0]

    def batches(step, k):
        box = local_box(tuple(shape), placement.shape, recipe.data_sbp, placement.coords(world_rank()))
        return {"input_ids": tokens[k][tuple(slice(a, a + n) for a, n in box)]}

    return job.pipe.infer(batches, PIECES, lambda module, x: recipe.stage_forward(module, x, None))


def test_infer_on_tp2_pp2_gives_one_devices_logits(sbp_cache):
    from recipes.registry import get
    from toolkit.plain_loop import PlainLoop

    overrides = [*TINY, f"data.cache_dir={sbp_cache}"]
    cfg = compose([*overrides, "parallel.tp=2", "parallel.pp=2"], run_dir=tempfile.mkdtemp())
    world = validate(cfg, get("gpt2")).world_size
    got = get_pool(world).run(_rank_infer, OmegaConf.to_container(cfg, resolve=True), call_timeout=600.0)
    assert all(r is None for r in got[1:]) and len(got[0]) == PIECES
    loop = PlainLoop(compose([*overrides, "parallel=single"], run_dir=tempfile.mkdtemp()), get("gpt2"), "cpu")
    loop.model.eval()
    tokens = _tokens(got[0][0].shape[:2])
    with torch.no_grad():
        want = [get("gpt2").stage_forward(loop.model, {"input_ids": t}, None) for t in tokens]
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[0], want)]
    assert all(a.shape == b.shape for a, b in zip(got[0], want)) and max(errs) <= 1e-5, errs
