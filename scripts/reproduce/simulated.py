"""The auto-parallel simulator set up for paper-scale GPT-2 predictions: one rehearsed model, priced per cluster.

``gpt_model(name, global_batch, micro)`` is the GPT-2 recipe as LiBai and
Megatron benchmark it (``scripts/cluster_layouts.py``'s setting: vocabulary
padded to 50304, bf16, activation checkpointing), wrapped for the search
(``toolkit.search.search_model.RecipeSearchModel``). Its stage
rehearsals are cached on the model and do not depend on the cluster, so one
model serves every cluster preset: ``evaluator(model, cluster)`` prices the
same traces with the cluster's roofline (``toolkit.search``). Nothing here
runs a training step; every number it yields is simulated.
"""
from __future__ import annotations


def gpt_overrides(model: str, global_batch: int, micro: int, seq: int | None = None) -> list:
    """Hydra overrides of the paper-scale GPT-2 job (``scripts/cluster_layouts.py``'s, plus an optional ``seq``)."""
    out = [f"model={model}", "model.vocab_size=50304", "trainer.precision=bf16",
           "trainer.activation_checkpointing=true", f"trainer.global_batch_size={global_batch}",
           f"trainer.micro_batch_size={micro}", "trainer.eval_every=0"]
    return out + ([f"data.seq_len={seq}"] if seq else [])


def gpt_model(overrides: list, per_layer: bool = False):
    """The recipe's search model for ``overrides`` (shapes only: no weights are allocated, whatever the size)."""
    from recipes.registry import get
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.config import compose

    cfg = compose(overrides, run_dir="/tmp/reproduce-simulated")
    return RecipeSearchModel(get(cfg.recipe.name), cfg, per_layer=per_layer)


def load_cluster(name: str, nodes: int | None = None):
    """The preset ``configs/cluster/<name>.yaml``, cut to its first ``nodes`` nodes when given."""
    import dataclasses

    from toolkit.search.cluster_file import load_cluster as load

    cluster = load(name)
    if nodes is not None:
        if not 1 <= nodes <= cluster.nodes:
            raise ValueError(f"nodes={nodes}: cluster {name} has 1..{cluster.nodes} nodes")
        if nodes != cluster.nodes:
            plural = "s" if nodes > 1 else ""
            cluster = dataclasses.replace(cluster, nodes=nodes, name=f"{cluster.name} ({nodes} node{plural})")
    if cluster.costs != "roofline":
        raise ValueError(f"cluster {name}: costs {cluster.costs!r}; paper-scale predictions need a roofline preset "
                         "(a measured machine is verified by scripts/verify_simulator.py)")
    return cluster


def evaluator(model, cluster):
    """An ``Evaluator`` pricing ``model``'s rehearsed stages with ``cluster``'s roofline."""
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.opcost import RooflineOpCosts

    return Evaluator(model, cluster, RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth, cluster.kernel_overhead))


def strategy(name: str, micro: int):
    """The ``Strategy`` of a layout name like ``dp8_tp2_pp2`` (``_zero1`` allowed) with ``micro`` rows per micro-batch."""
    from toolkit.search.strategy import Strategy

    return Strategy.from_name(name, micro)
