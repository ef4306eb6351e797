"""``train.py recipe=llama model=mixtral-tiny``: Mixtral's sparse MLP trains like one device with its experts split
over the data-parallel ranks, inside tensor and pipeline parallelism and under ZeRO-3; what it does not do is
refused before any process starts.

The tiny LLaMA of ``test_llama_cli.py`` with 4 experts, 2 per token, a capacity that drops choices and a
load-balancing weight of 0.01, 3 steps; the per-step losses equal one process's.
"""
from __future__ import annotations

import pytest

from recipes.registry import get
from tests.cli.pooled import train_pooled
from tests.cli.test_llama_cli import TINY
from toolkit.config import ConfigError, compose, validate

MIXTRAL = [*TINY, "model=mixtral-tiny", "model.capacity_factor=1.0", "model.router_aux_loss_coef=0.01"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, sbp_cache):
    return train_pooled([*MIXTRAL, "parallel=single"], tmp_path_factory.mktemp("mixtral-single"), sbp_cache)


@pytest.mark.parametrize("layout", ["dp2_tp2_pp2 parallel.pp_virtual=2", "dp2_tp2_zero3"])
def test_expert_parallel_layouts_train_like_one_device(layout, single, sbp_cache, tmp_path):
    layout, *options = layout.split()
    losses = train_pooled([*MIXTRAL, f"parallel={layout}", *options], tmp_path, sbp_cache)
    assert len(losses) == len(single) == 3
    for a, b in zip(losses, single):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, losses, single)


@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts_per_tok=5"], "model.num_experts_per_tok=5: must be between 1 and model.num_local_experts=4"),
    (["parallel=dp8"], "model.num_local_experts=4: must divide by parallel.dp=8 (expert parallelism"),
    (["model.capacity_factor=-1"], "model.capacity_factor=-1.0, model.router_aux_loss_coef=0.01: both must be >= 0"),
    (["parallel=cp2"], "parallel.cp=2 with model.num_local_experts=4"),
])
def test_what_the_experts_cannot_do_is_refused_before_any_process_starts(overrides, message, tmp_path):
    cfg = compose([*MIXTRAL, *overrides], run_dir=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        validate(cfg, get("llama"), world_size=None)
    assert message in str(info.value)
