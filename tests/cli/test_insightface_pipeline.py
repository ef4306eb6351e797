"""``recipe=insightface`` split into pipeline stages trains as one device does.

An iResNet's blocks change shape from stage to stage (channels double and the
feature map halves at each of its four stages), so each stage boundary
carries the shape its producing stage returns (``toolkit.stages.boundary_specs``).
pp2, dp2_pp2 and pp4 (every boundary a different shape), pp2 with two
stages per rank under interleaved 1F1B and ZB-V, dp2 under ZeRO-1 and
ZeRO-3, and dp2 (whose
data-parallel stage audits its first micro-batch on plain tensors, which
must leave batch norm's running statistics alone), dp2 and pp2 with every
block recomputed in backward (activation checkpointing, whose recompute
must leave them alone too; pp2's split last backward recomputes twice),
3 SGD steps of 4
micro-batches, fp32, dropout off: every step's loss and, after the last
step, every parameter and batch-norm statistic equal a plain PyTorch loop
on one device that trains on its own (``toolkit.plain_loop.PlainLoop``: its
own forward, backward and optimizer, from the same seed and the same
batches): losses within 1e-5 relative, tensors within 1e-5 of their largest
magnitude floored at 0.1. The floor: a bias that feeds a batch norm gets a
gradient that is zero up to rounding, so it stays near 1e-9 and differs by
its rounding (measured: 5e-9 absolute, 1.4x its own size), as do the
running means of a batch norm over another's output. Measured with the
floor: losses within 3.6e-7 (pp2, pp4) and 2.1e-6 (dp2_pp2, dp2), tensors
within 3.1e-6 and 5.6e-6.

After the steps, each pipelined layout embeds the verification pairs (and
their mirror images) through its stages in micro-batch pieces, forward only
(``PipelineStep.infer``): the embeddings on rank 0 equal the one-device
model's in eval mode, within the same bars, and ``evaluate`` gives rank 0
the verification metrics.
"""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from toolkit.config import compose, validate
from toolkit.rank_pool import get_pool

TINY = ["recipe=insightface", "model.width=4", "model.image_size=16", "model.num_classes=10",
        "model.head.embedding_size=16", "data.synthetic.images_per_identity=4", "data.synthetic.val_identities=10",
        "data.synthetic.val_pairs=40", "trainer.global_batch_size=32", "trainer.max_steps=3",
        "trainer.warmup_steps=1", "trainer.eval_every=100", "trainer.save_every=0", "logger=none"]
STEPS, RTOL, FLOOR = 3, 1e-5, 0.1
# layout -> its overrides; 4 micro-batches of 8 images in every layout (micro_batch_size is per data shard)
LAYOUTS = {"pp2": ["parallel.pp=2", "trainer.micro_batch_size=8"],
           "dp2_pp2": ["parallel.dp=2", "parallel.pp=2", "trainer.micro_batch_size=4"],
           "pp4": ["parallel.pp=4", "trainer.micro_batch_size=8"],
           "dp2": ["parallel.dp=2", "trainer.micro_batch_size=4"],
           # two stages per rank: interleaved 1F1B, and ZB-V (split backwards, the first and last stage on rank 0)
           "pp2_v2": ["parallel.pp=2", "parallel.pp_virtual=2", "trainer.micro_batch_size=8"],
           "pp2_zbv": ["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=zbv",
                       "trainer.micro_batch_size=8"],
           # each block recomputed in backward: batch norm's running statistics updated once, by the forward
           "dp2_ac": ["parallel.dp=2", "trainer.micro_batch_size=4", "trainer.activation_checkpointing=true"],
           "pp2_ac": ["parallel.pp=2", "trainer.micro_batch_size=8", "trainer.activation_checkpointing=true"],
           # ZeRO on the replicated backbone: its momentum sharded over dp (1); its weights too, gathered per
           # block and freed after (3), with batch norm's buffers beside them
           "dp2_zero1": ["parallel.dp=2", "parallel.zero=1", "trainer.micro_batch_size=4"],
           "dp2_zero3": ["parallel.dp=2", "parallel.zero=3", "trainer.micro_batch_size=4"],
           "single": ["trainer.micro_batch_size=8"]}


def _pairs(images):
    """The images verification embeds: the pairs' images, then their mirror images."""
    import torch

    return torch.cat([images, images.flip(-1)])


def _rank_run(container: dict):
    """Each stage leader returns ``(losses or None, {name: full tensor} of its stage's state, embeddings and
    metrics of the pairs or None)``: the last two on rank 0 of a pipeline, after the steps."""
    import sbp_core as sc
    from recipes.registry import get
    from toolkit.trainer import Job

    cfg = OmegaConf.create(container)
    recipe = get(cfg.recipe.name)
    job = Job(cfg, recipe)
    assert (job.zero.stage if job.zero else 0) == cfg.parallel.zero  # ZeRO runs where the layout asks
    losses = [job.pipe.step(i) for i in range(STEPS)]
    losses = None if losses[0] is None else [float(x) for x in losses]
    state = {}
    for name, t in job.module.state_dict().items():
        full = t.full_tensor() if isinstance(t, sc.GlobalTensor) else t
        state[name] = full.detach().clone()
    embedded = None
    if job.layout.pp > 1:
        embedded = (recipe._embed_pipelined(job, _pairs(job.data.pairs[0])), recipe.evaluate(job))
    return losses, state, embedded


def _config(layout: str, cache: str, run_dir: str):
    return compose([*TINY, *LAYOUTS[layout], f"data.cache_dir={cache}"], run_dir=run_dir)


def _reference(cache: str, run_dir: str):
    from recipes.registry import get
    from toolkit.plain_loop import PlainLoop

    import torch

    from recipes.insightface.data.images import normalize

    cfg = _config("single", cache, run_dir)
    recipe = get("insightface")
    loop = PlainLoop(cfg, recipe, "cpu")
    losses = [float(loop.step(i)) for i in range(STEPS)]
    images, _ = recipe.prepare(loop.cfg).pairs
    loop.model.eval()
    with torch.no_grad():
        emb = loop.model.embed(normalize(_pairs(images)))
    return losses, {k: v.detach() for k, v in loop.model.state_dict().items()}, emb


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sbp_cache):
    return _reference(sbp_cache, str(tmp_path_factory.mktemp("single")))


@pytest.mark.parametrize("layout", ["pp2", "dp2_pp2", "pp4", "dp2", "pp2_v2", "pp2_zbv", "dp2_ac", "pp2_ac",
                                    "dp2_zero1", "dp2_zero3"])
def test_pipelined_insightface_matches_one_device(layout, reference, tmp_path, sbp_cache):
    from recipes.registry import get

    cfg = _config(layout, sbp_cache, str(tmp_path))
    world = validate(cfg, get("insightface")).world_size
    res = get_pool(world).run(_rank_run, OmegaConf.to_container(cfg, resolve=True), call_timeout=600.0)
    want_losses, want_state, want_emb = reference
    losses = res[0][0]
    assert losses is not None and len(losses) == STEPS
    bad = [f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(losses, want_losses))
           if abs(a - b) > RTOL * abs(b)]
    seen = set()
    embedded = res[0][2]
    if layout.startswith(("pp", "dp2_pp")):
        assert embedded[0] is not None and all(r[2] == (None, None) for r in res[1:])
        emb, metrics = embedded
        err = float((emb - want_emb).abs().max() / want_emb.abs().max().clamp_min(FLOOR))
        if emb.shape != want_emb.shape or not err <= RTOL:
            bad.append(f"embeddings {tuple(emb.shape)}: {err:.2e}")
        assert set(metrics) >= {"verify_acc"} and 0.0 <= metrics["verify_acc"] <= 1.0, metrics
    for _, state, _ in res:
        for name, got in state.items():
            if name in seen or not got.is_floating_point():
                continue
            seen.add(name)
            want = want_state[name]
            err = float((got - want).abs().max() / want.abs().max().clamp_min(FLOOR))
            if not err <= RTOL:
                bad.append(f"{name}: {err:.2e}")
    assert seen == {k for k, v in want_state.items() if v.is_floating_point()}, \
        sorted(set(want_state) ^ seen)
    assert not bad, "\n".join(bad)
