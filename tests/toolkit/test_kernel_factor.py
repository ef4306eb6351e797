"""The searched model's host costs: a real plain step of each recipe's model on synthetic fields, the summed
costs of the same step's rehearsed calls, and the two-device forward and backward in a fake world (measured
figures, so only their parts are checked here)."""
from __future__ import annotations

import math

import pytest

from tests.cli.test_insightface_cli import TINY as INSIGHTFACE
from tests.cli.test_train_cli import TINY as GPT2
from tests.cli.test_wide_deep_cli import TINY as WIDE_DEEP


def _cfg(overrides, tmp_path):
    from recipes.registry import get
    from toolkit.config import compose, typed

    cfg = compose(list(overrides), run_dir=str(tmp_path))
    recipe = get(cfg.recipe.name)
    return recipe, typed(cfg, recipe)


# GPT-2's and InsightFace's plain steps also run in ``test_host_costs_run_the_two_device_stage_in_a_fake_world``.
def test_a_plain_step_runs_on_synthetic_fields(tmp_path):
    from toolkit.search.kernel_factor import cpu_seconds, plain_step

    recipe, cfg = _cfg(WIDE_DEEP, tmp_path)
    seconds = cpu_seconds(plain_step(recipe, cfg, rows=2))
    assert math.isfinite(seconds) and seconds > 0


def test_rehearsed_kernels_sum_the_step_phases_calls(tmp_path):
    from toolkit.search.rehearsal import OpCall
    from toolkit.search.strategy import Strategy
    from toolkit.search.kernel_factor import rehearsed_kernel_seconds
    from toolkit.search.search_model import RecipeSearchModel

    class Fixed:  # 1 ms per call
        def seconds(self, call):
            return 1e-3

    recipe, cfg = _cfg(GPT2, tmp_path)
    model = RecipeSearchModel(recipe, cfg)
    trace = model.trace(Strategy(micro_batch_size=2), 0)
    calls = sum(isinstance(e, OpCall) for name in ("F", "B0", "update") for e in trace.phases[name].events)
    assert calls > 0
    assert rehearsed_kernel_seconds(model, Strategy(micro_batch_size=2), Fixed()) == pytest.approx(calls * 1e-3)


# Wide&Deep is left out: its sparse embeddings' lookups are data-dependent (aten.nonzero), so its stages are not
# rehearsed at all (the search covers GPT-2 and InsightFace).
@pytest.mark.parametrize("overrides", [GPT2, INSIGHTFACE], ids=["gpt2", "insightface"])
def test_host_costs_run_the_two_device_stage_in_a_fake_world(overrides, tmp_path):
    """``model_host_costs``: the plain step and the two-device forward and backward both run for the recipes the
    search covers, the dispatch residual is per rehearsed global op, and the fake world is gone afterwards (a
    real one can start)."""
    import torch.distributed as dist

    from toolkit.search.dispatch_cost import model_host_costs
    from toolkit.search.search_model import RecipeSearchModel

    class Fixed:  # every kernel next to nothing: the residual is about the whole forward and backward
        def seconds(self, call):
            return 1e-9

    recipe, cfg = _cfg(overrides, tmp_path)
    model = RecipeSearchModel(recipe, cfg)
    factor, dispatch = model_host_costs(model, Fixed(), rows=2, repeats=1)
    assert math.isfinite(factor) and factor > 0
    assert 0 < dispatch < 0.1  # seconds per op: the step's CPU spread over its hundreds of global ops
    assert not dist.is_initialized()
