"""``parallel=auto``: search a plan for this model on a cluster (or reuse the cached one), then train with it.

``find_plan(cfg, recipe)`` runs ``toolkit.search``'s Metropolis-Hastings
search (``parallel.search.*``: cluster file, devices, budget, beta, seed)
over dp/tp/pp, ZeRO, micro-batch size, sequence parallel and per-op layouts,
seeded with data parallel and Megatron's layout, and writes the best plan as
a plan file (JSON: the strategy, its name, predicted step time and memory,
the cluster) under ``parallel.search.cache_dir``, keyed by everything the
search depends on (recipe, model, data shapes, trainer settings that change
the step, cluster file, devices, search knobs). The next run with the same
key loads it instead of searching. ``resolve(cfg, ...)`` returns the config
that trains it: the strategy's degrees, ZeRO stage, sequence parallel,
``parallel.plan`` (per-op layouts) and micro-batch size, ``auto`` off.

The search rehearses stages in a fake world (``toolkit.search.rehearsal``),
so it must run where ``torch.distributed`` is not initialised: in
``train.py`` before it launches ranks (under torchrun every process finds
the same plan: the search is deterministic, or the cached file is there).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from toolkit.search.strategy import Strategy
from toolkit.config import typed

from .cluster_file import load_cluster
from .space import PIPELINES
from .stage_spec import mesh_plan, strategy_cfg

PLAN_FORMAT = 2  # 2: the strategy holds the pipeline schedule and stages per rank


def _devices(cfg, cluster) -> tuple:
    """``(devices, use all of them)``: the launcher's world when launched, else the cluster's (any power of two on a shared CPU)."""
    from toolkit.config import cluster_env

    env = cluster_env()
    if cfg.parallel.search.devices:
        return int(cfg.parallel.search.devices), not cluster.cores
    if env is not None and env.world_size:
        return int(env.world_size), True
    return cluster.devices, not cluster.cores


def plan_key(cfg, recipe, cluster_text: str, devices: int) -> str:
    """A digest of everything the found plan depends on."""
    tr = OmegaConf.to_container(cfg.trainer, resolve=True)
    search = OmegaConf.to_container(cfg.parallel.search, resolve=True)
    parts = {"recipe": recipe.name, "model": OmegaConf.to_container(cfg.model, resolve=True),
             "data": repr(recipe.batch_fields(cfg)),
             "trainer": {k: tr.get(k) for k in ("global_batch_size", "precision", "activation_checkpointing",
                                                 "grad_clip", "optimizer")},
             "cluster": cluster_text, "devices": devices,
             "search": {k: v for k, v in search.items() if k != "cache_dir"}, "format": PLAN_FORMAT,
             "pipelines": PIPELINES}  # a schedule the search may newly pick: search again
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_path(cfg, recipe) -> tuple:
    cluster_file = cfg.parallel.search.cluster
    cluster = load_cluster(cluster_file)
    devices, _ = _devices(cfg, cluster)
    key = plan_key(cfg, recipe, Path(cluster.source).read_text(), devices)
    cache = Path(os.path.expanduser(str(cfg.parallel.search.cache_dir)))
    return cache / f"{recipe.name}-{key}.json", cluster


def refuse_context(cfg) -> None:
    """``ConfigError`` for ``parallel.cp > 1``: the search lays out dp, tp and pp only, and a plan found for them
    would run on cp times as many processes (and share the cache file of the ``cp=1`` config)."""
    if int(cfg.parallel.get("cp", 1)) != 1:
        from toolkit.config import ConfigError

        raise ConfigError([f"parallel.cp={cfg.parallel.cp} with parallel.auto=true: the search lays out dp, tp and pp "
                           "only; valid: cp=1, or a layout of your own"])


def search_plan(cfg, recipe, progress: bool = True, log=print):
    """Run the search; returns ``(SearchResult, search model)``. Refuses ``parallel.cp > 1`` (``refuse_context``)."""
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.mcmc import search
    from toolkit.search.opcost import MeasuredOpCosts, RooflineOpCosts, measurement_cache
    from toolkit.search.threadgain import MeasuredThreadGain
    from toolkit.search.space import SearchSpace

    from .dispatch_cost import model_host_costs
    from .search_model import RecipeSearchModel

    cfg = typed(cfg, recipe)
    refuse_context(cfg)
    s = cfg.parallel.search
    cluster = load_cluster(s.cluster)
    devices, all_devices = _devices(cfg, cluster)
    gains = None
    if cluster.costs == "measured":  # measured now, as the kernel factor below is (MeasuredOpCosts.refresh)
        costs = MeasuredOpCosts(measurement_cache(1), threads=1, refresh=True)
        gains = MeasuredThreadGain(measurement_cache(2), threads=2)
    else:
        costs = RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth, cluster.kernel_overhead)
    model = RecipeSearchModel(recipe, cfg)
    if cluster.costs == "measured":  # this model's kernels and dispatch in its own steps, not the calibration GPT-2s'
        factor, dispatch = model_host_costs(model, costs, int(cfg.trainer.micro_batch_size))
        cluster = dataclasses.replace(cluster, kernel_factor=factor, host_overhead=dispatch)
    space = SearchSpace(model, devices, all_devices=all_devices)
    log(f"searching plans for {recipe.name} on {cluster.name} ({devices} devices{'' if all_devices else ' at most'}; "
        f"budget {s.budget}, beta {s.beta})")
    result = search(space, Evaluator(model, cluster, costs, gains), budget=int(s.budget), beta=float(s.beta),
                    seed=int(s.seed), devices_per_node=cluster.devices_per_node, progress=progress)
    costs.save()
    if gains is not None:
        gains.save()
    return result, model


def write_plan(path, result, model, cluster) -> dict:
    best = result.best
    doc = {"format": PLAN_FORMAT, "name": best.strategy.name, "strategy": best.strategy.to_dict(),
           "predicted_step_seconds": best.step_seconds, "peak_memory_bytes": int(best.peak_memory),
           "memory_capacity_bytes": int(best.capacity), "cluster": cluster.name,
           "micro_batches": model.micro_batches(best.strategy),
           "seeds": {p.strategy.name: p.step_seconds for p in result.seeds},
           "search": {"evaluated": result.evaluated, "accepted": result.accepted, "rejected": result.rejected,
                      "invalid": result.invalid}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)
    return doc


def read_plan(path) -> Strategy:
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"plan file {path}: format {doc.get('format')!r}, expected {PLAN_FORMAT}")
    return Strategy.from_dict(doc["strategy"])


def resolve(cfg, recipe, log=print):
    """``cfg`` with ``parallel.auto`` replaced by the found (or cached) plan (a context-parallel config is refused
    first, ``refuse_context``)."""
    cfg = typed(cfg, recipe)
    refuse_context(cfg)
    path, cluster = plan_path(cfg, recipe)
    if path.exists():
        strategy = read_plan(path)
        log(f"parallel=auto: cached plan {path}: {strategy.describe()}")
    else:
        from .report import describe

        result, model = search_plan(cfg, recipe, log=log)
        write_plan(path, result, model, cluster)
        strategy = result.best.strategy
        log(describe(result.best, mesh_plan(recipe, cfg, strategy), model.shapes, model.micro_batches(strategy)))
        log(f"parallel=auto: plan {strategy.name} written to {path}")
    return strategy_cfg(cfg, recipe, strategy)
