"""The LLaMA recipe: GPT-2's token data and training loop with a LLaMA-style model and its plan.

Everything about the data (the corpus, the tokenizer, its checks) is the
GPT-2 recipe's (``recipes.gpt2.recipe``); what differs is the model
(``model.py``), its plan and pipeline split (``plan.py``), its checks
(``config.py``) and its FLOPs. Weights come from this project's checkpoints;
Hugging Face directories are not read.
"""
from __future__ import annotations

from recipes.gpt2.recipe import GPT2Recipe
from toolkit.recipe import Recipe

from . import config
from .model import LlamaConfig, LlamaForCausalLM
from .plan import ACT_SBP, DATA_SBP, PIPELINE, mesh_plan


class LlamaRecipe(GPT2Recipe):
    """Next-token prediction on a tokenized corpus with a LLaMA-style decoder; Megatron's layout in SBP.

    One batch field, ``input_ids`` (``[seq_len]`` int64 per sample), read by
    the first stage (the tokens) and the last (the labels, shifted there).
    """

    name = "llama"
    model_schema = config.ModelConfig
    data_schema = config.DataConfig
    data_sbp = DATA_SBP
    act_sbp = ACT_SBP
    pipeline = PIPELINE
    tied = ()

    def check(self, cfg, layout) -> list:
        return config.problems(cfg, layout, trains_tokenizer=self.tokenizer_path(cfg) is None)

    def n_layers(self, model_cfg) -> int:
        return int(model_cfg.num_hidden_layers)

    def build_model(self, model_cfg) -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig(**config.llama_config_kwargs(model_cfg)))

    def mesh_plan(self, cfg) -> dict:
        return mesh_plan(bool(cfg.parallel.sequence_parallel))

    def flops_per_item(self, cfg, n_params: int) -> float:
        """Training FLOPs per token: 6 per parameter of the matmuls (the embedding is a lookup), plus
        attention's scores and weighted sum, 6 * 2 * layers * seq * hidden (half of it under the causal
        mask is still computed)."""
        m = cfg.model
        matmuls = n_params - m.vocab_size * m.hidden_size
        return 6.0 * matmuls + 12.0 * m.num_hidden_layers * int(cfg.data.seq_len) * m.hidden_size

    def weights_path(self, init_from: str) -> str | None:
        return Recipe.weights_path(self, init_from)

    def reads_weights(self, path: str) -> bool:
        return False

    def weights_problems(self, path: str, cfg) -> list:
        return []

    def init_weights(self, model, path: str, cfg) -> bool:
        return False

    def extra_state(self, cfg) -> dict:
        return {"model_config": config.llama_config_kwargs(cfg.model)}


RECIPE = LlamaRecipe()
