"""``model_kernel_factor``'s two halves: a real plain step of each recipe's model on synthetic fields, and the
summed costs of the same step's rehearsed calls (a measured figure, so only its parts are checked here)."""
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


@pytest.mark.parametrize("overrides", [GPT2, INSIGHTFACE, WIDE_DEEP], ids=["gpt2", "insightface", "wide_deep"])
def test_a_plain_step_runs_on_synthetic_fields(overrides, tmp_path):
    from toolkit.autoparallel.kernel_factor import measured_step_seconds

    recipe, cfg = _cfg(overrides, tmp_path)
    seconds = measured_step_seconds(recipe, cfg, rows=2, repeats=1)
    assert math.isfinite(seconds) and seconds > 0


def test_rehearsed_kernels_sum_the_step_phases_calls(tmp_path):
    from recipes.zero import apply_zero
    from sbp_core.search.rehearsal import OpCall
    from sbp_core.search.strategy import Strategy
    from toolkit.autoparallel.kernel_factor import rehearsed_kernel_seconds
    from toolkit.autoparallel.search_model import RecipeSearchModel

    class Fixed:  # 1 ms per call
        def seconds(self, call):
            return 1e-3

    recipe, cfg = _cfg(GPT2, tmp_path)
    model = RecipeSearchModel(recipe, cfg, apply_zero)
    trace = model.trace(Strategy(micro_batch_size=2), 0)
    calls = sum(isinstance(e, OpCall) for name in ("F", "B0", "update") for e in trace.phases[name].events)
    assert calls > 0
    assert rehearsed_kernel_seconds(model, Strategy(micro_batch_size=2), Fixed()) == pytest.approx(calls * 1e-3)
