"""``parallel=auto``: a found plan (per-op layouts included) trains with single's losses; plans are cached."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from toolkit.search.strategy import Strategy
from tests.cli.test_train_cli import TINY

# Exotic on purpose: a replicated MLP input projection, a row-split qkv and a column-split embedding.
OPS = {"transformer.h.0.mlp.c_fc.weight": "B", "transformer.h.0.mlp.c_fc.bias": "B",
       "transformer.h.1.attn.c_attn.weight": "S(0)", "transformer.wte.weight": "S(1)",
       "lm_head.weight": "S(1)"}


def _resolved(tmp_path, sbp_cache, strategy):
    """What ``parallel=auto`` resolves to when ``strategy``'s plan file is cached."""
    from recipes.registry import get
    from toolkit.search.auto import PLAN_FORMAT, plan_path, resolve
    from toolkit.config import compose

    base = [*TINY, "parallel=auto", f"parallel.search.cache_dir={tmp_path}/plans", f"data.cache_dir={sbp_cache}"]
    cfg = compose(base, run_dir=str(tmp_path / "run"))
    recipe = get(cfg.recipe.name)
    path, _ = plan_path(cfg, recipe)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": PLAN_FORMAT, "name": strategy.name, "strategy": strategy.to_dict()}))
    out = resolve(cfg, recipe, log=lambda *_: None)
    par = out.parallel
    assert (par.dp, par.tp, par.pp, par.auto) == (strategy.dp, strategy.tp, strategy.pp, False)
    assert dict(par.plan) == dict(strategy.ops) and out.trainer.micro_batch_size == strategy.micro_batch_size
    assert (par.pp_schedule, par.pp_virtual) == (strategy.schedule, strategy.virtual)
    return out, recipe


def test_auto_plan_with_per_op_layouts_trains_like_single(single_run, sbp_cache, tmp_path):
    from tests.cli.pooled import _rank_train, losses
    from toolkit.config import save_resolved_config, validate
    from toolkit.rank_pool import get_pool

    single = single_run[1]
    strategy = Strategy(dp=1, tp=2, pp=2, micro_batch_size=2, ops=tuple(OPS.items()))
    cfg, recipe = _resolved(tmp_path, sbp_cache, strategy)
    layout = validate(cfg, recipe)  # as train.py does after resolving
    save_resolved_config(cfg, cfg.run_dir)
    get_pool(layout.world_size).run(_rank_train, OmegaConf.to_container(cfg, resolve=True), call_timeout=900)
    got = losses(tmp_path / "run")
    assert len(got) == 3 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, single)), (got, single)
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert dict(saved.parallel.plan) == OPS


def test_search_writes_a_plan_file_that_resolve_reuses(tmp_path, sbp_cache):
    from recipes.registry import get
    from toolkit.search.auto import plan_path, read_plan, resolve
    from toolkit.config import compose

    cluster = tmp_path / "toy.yaml"
    cluster.write_text("""name: toy
nodes: 1
devices_per_node: 2
device: {memory_gib: 1, peak_tflops: {float32: 1.0}, memory_bandwidth_gbs: 10}
links: {intra_node: {bandwidth_gbs: 1, latency_us: 10}}
""")
    cfg = compose([*TINY, "model.n_layer=2", "parallel=auto", f"parallel.search.cluster={cluster}",
                   "parallel.search.budget=2",
                   f"parallel.search.cache_dir={tmp_path}/plans", f"data.cache_dir={sbp_cache}"],
                  run_dir=str(tmp_path / "run"))
    recipe = get(cfg.recipe.name)
    lines = []
    out = resolve(cfg, recipe, log=lines.append)
    path, _ = plan_path(cfg, recipe)
    found = read_plan(path)
    assert found.world == 2 and (out.parallel.dp, out.parallel.tp, out.parallel.pp) == (found.dp, found.tp, found.pp)
    assert any("per-op signatures" in line for line in lines)
    again = []
    resolve(cfg, recipe, log=again.append)
    assert again and "cached plan" in again[0]
