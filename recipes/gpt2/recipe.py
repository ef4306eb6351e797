"""The GPT-2 recipe: the model, its plan and its pipeline split, for ``toolkit.trainer``."""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from toolkit.config import gpt2_config_kwargs
from toolkit.recipe import Recipe

from .model import GPT2Config, GPT2LMHeadModel
from .plan import ACT_SBP, DATA_SBP, PIPELINE, TIED, mesh_plan, stage_forward


def build_model(model_cfg) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(**gpt2_config_kwargs(model_cfg)))


def checkpoint_layers(module) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them."""
    for block in module.transformer.h:
        if block is not None:
            inner = block.forward
            block.forward = lambda x, inner=inner: checkpoint(inner, x, use_reentrant=False)


RECIPE = Recipe(
    name="gpt2", build_model=build_model, mesh_plan=mesh_plan, pipeline=PIPELINE, stage_forward=stage_forward,
    data_sbp=DATA_SBP, act_sbp=ACT_SBP, hidden_size=lambda m: m.n_embd, checkpoint_layers=checkpoint_layers,
    tied=TIED,
)
