"""The recipe as the search sees it: deep stages priced from shallow rehearsals, and per-op choice points."""
from __future__ import annotations

from collections import Counter

import pytest

from toolkit.search.strategy import Strategy

TINY = ["model=gpt2-tiny", "model.n_layer=5", "model.n_embd=32", "model.n_head=2", "model.vocab_size=512",
        "model.n_positions=16", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def models():
    from recipes.registry import get
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.config import compose

    cfg = compose(TINY, run_dir="/tmp/autoparallel-model")
    recipe = get(cfg.recipe.name)
    return RecipeSearchModel(recipe, cfg, direct_blocks=3), RecipeSearchModel(recipe, cfg, direct_blocks=10)


def test_five_layers_from_two_and_three(models):
    shallow, direct = models
    s = Strategy(dp=1, tp=2, micro_batch_size=2)
    got, want = shallow.trace(s, 0), direct.trace(s, 0)
    assert shallow.rehearsals == 2 and direct.rehearsals == 1
    for name, ph in want.phases.items():
        keys = Counter(c.key for c in got.phases[name].calls)
        assert keys == Counter(c.key for c in ph.calls), name
        assert Counter(got.phases[name].collectives) == Counter(ph.collectives), name
        assert len(got.phases[name].global_ops) == len(ph.global_ops), name
    for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "stash_bytes", "act_bytes"):
        assert getattr(got, k) == getattr(want, k), k


def test_choices_and_validity(models):
    model, _ = models
    names = [c.name for c in model.choices]
    assert "transformer.h.0.mlp.c_fc" in names and any("wte" in n and "lm_head" in n for n in names)
    tied = next(c for c in model.choices if "wte" in c.name)
    assert all(len(set(cand)) == 1 for cand in tied.candidates)  # one layout for both names of the tied weight
    fc = next(c for c in model.choices if c.name == "transformer.h.0.mlp.c_fc")
    own = dict(zip((p for p, _ in fc.params), fc.candidates[0]))  # the recipe's own comes first
    assert own == {"transformer.h.0.mlp.c_fc.weight": "S(1)", "transformer.h.0.mlp.c_fc.bias": "S(0)"}
    s = model.apply_choice(Strategy(dp=1, tp=2, micro_batch_size=2), fc, 1)
    assert dict(s.ops) and not model.problems(s)
    assert model.problems(Strategy(dp=1, tp=3, micro_batch_size=2))  # 2 heads do not split over 3


def test_insightface_is_traced_and_priced():
    """A vision recipe with no pipeline: the batch split over the whole mesh, a class-split FC head."""
    from recipes.registry import get
    from toolkit.search.cluster import cluster_from_dict
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.opcost import RooflineOpCosts
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.config import compose

    cfg = compose(["recipe=insightface", "trainer.global_batch_size=16", "trainer.micro_batch_size=4"],
                  run_dir="/tmp/autoparallel-insightface")
    model = RecipeSearchModel(get("insightface"), cfg)
    assert [c.name for c in model.choices] == ["head"]
    assert model.micro_batches(Strategy(dp=2, tp=2, micro_batch_size=4)) == 1  # 4 data shards
    # Verification embeds through the pipeline's stages: a pipeline with it is a candidate.
    assert not any("eval_every" in p for p in model.problems(Strategy(dp=1, tp=1, pp=2, micro_batch_size=4)))
    assert not model.layers_alike  # a ResNet's blocks change width: each stage is rehearsed whole
    cluster = cluster_from_dict({"name": "toy", "nodes": 1, "devices_per_node": 4,
                                 "device": {"memory_gib": 1, "peak_tflops": {"float32": 1.0},
                                            "memory_bandwidth_gbs": 10},
                                 # 10 GB/s: with ops on one device running their plain signatures (no
                                 # decomposition on a mesh axis of one device), 1 GB/s links made the
                                 # 4-device step's collectives cost more than the compute it saves.
                                 "links": {"intra_node": {"bandwidth_gbs": 10, "latency_us": 10}}})
    ev = Evaluator(model, cluster, RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth))
    one, four = ev.predict(Strategy(micro_batch_size=4)), ev.predict(Strategy(dp=2, tp=2, micro_batch_size=4))
    head = [g for g in four.traces[0].phases["F"].global_ops if g.module == "head" and g.op == "aten.mm.default"]
    assert head and head[0].outputs[0][1].is_split  # logits split over the classes on the tp axis
    assert four.traces[0].phases["reduce"].collectives and not one.traces[0].phases["reduce"].collectives
    assert four.step_seconds < one.step_seconds
    piped = RecipeSearchModel(get("insightface"), compose(
        ["recipe=insightface", "trainer.global_batch_size=16", "trainer.micro_batch_size=4", "trainer.eval_every=0"],
        run_dir="/tmp/autoparallel-insightface"))
    pp2 = Strategy(pp=2, micro_batch_size=4)
    assert not piped.problems(pp2)
    two = Evaluator(piped, cluster, RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth)).predict(pp2)
    assert [t.act_bytes for t in two.traces] == [4 * 32 * 8 * 8 * 4, 0]  # layer2 out: [4, 2*16, 32/4, 32/4] fp32


def _layers(n: int):
    from recipes.registry import get
    from toolkit.search.search_model import RecipeSearchModel
    from toolkit.config import compose

    cfg = compose([*TINY, f"model.n_layer={n}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"],
                  run_dir="/tmp/autoparallel-schedules")
    return RecipeSearchModel(get(cfg.recipe.name), cfg)


@pytest.fixture(scope="module")
def four_layers():
    return _layers(4)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("1f1b", 2), ("gpipe", 1), ("zb", 1), ("zb", 2), ("zbv", 2)])
def test_every_schedule_is_priced_from_the_same_plan(four_layers, schedule, virtual):
    """pp2 under each schedule: the task graph has the runtime's actors (a pool per rank with several stages,
    weight passes under zero bubble) and memory per pipeline rank counts every stage it holds."""
    from toolkit.search.cluster import cluster_from_dict
    from toolkit.search.evaluate import Evaluator
    from toolkit.search.opcost import RooflineOpCosts

    cluster = cluster_from_dict({"name": "toy", "nodes": 1, "devices_per_node": 2,
                                 "device": {"memory_gib": 1, "peak_tflops": {"float32": 1.0},
                                            "memory_bandwidth_gbs": 10},
                                 "links": {"intra_node": {"bandwidth_gbs": 10, "latency_us": 10}}})
    ev = Evaluator(four_layers, cluster, RooflineOpCosts(cluster.peak_flops, cluster.mem_bandwidth))
    s = Strategy(pp=2, micro_batch_size=2, schedule=schedule, virtual=virtual)
    assert not four_layers.problems(s)
    p = ev.predict(s)
    names = {a.name for a in p.graph.actors}
    assert len(p.traces) == 2 * virtual and len(p.memory) == 2 and p.step_seconds > 0
    assert bool(p.graph.pools) == (virtual > 1)
    assert any(n.endswith(".W") for n in names) == (schedule in ("zb", "zbv"))
    if schedule == "zbv":  # the first and last stage on rank 0: no tied-gradient exchange
        assert "tied" not in names
    one = ev.predict(Strategy(pp=2, micro_batch_size=2))
    # Rank 0 against 1F1B's: the same under ZB-H1 (a budget of pp, its layers); more with a second stage (its
    # parameters, the budget of more micro-batches) and under GPipe (every micro-batch held).
    assert p.memory[0] == one.memory[0] if (schedule, virtual) in (("1f1b", 1), ("zb", 1)) else \
        p.memory[0] > one.memory[0]


@pytest.mark.parametrize("n_layer", [4, 6])
def test_the_search_moves_between_schedules(four_layers, n_layer):
    """pp2: every pipeline whose ``2 v`` stages divide the layers is reached, the others refused (four layers
    make 2 or 4 stages, six 2 or 6)."""
    import random

    from toolkit.search.space import PIPELINES, SearchSpace

    model = four_layers if n_layer == 4 else _layers(n_layer)
    space = SearchSpace(model, 2)
    rng, seen = random.Random(0), set()
    s = Strategy(pp=2, micro_batch_size=2)
    for _ in range(200):
        t = space.propose(s, rng)
        if (t.dp, t.tp, t.pp) == (1, 1, 2) and space.valid(t):
            seen.add((t.schedule, t.virtual))
    assert seen | {("1f1b", 1)} == {p for p in PIPELINES if n_layer % (2 * p[1]) == 0}
