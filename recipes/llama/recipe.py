"""The LLaMA recipe: GPT-2's token data and training loop with a LLaMA-style model and its plan.

Everything about the data (the corpus, the tokenizer, its checks) is the
GPT-2 recipe's (``recipes.gpt2.recipe``); what differs is the model
(``model.py``), its plan and pipeline split (``plan.py``), its checks
(``config.py``), its FLOPs and ``trainer.init_from`` of a Hugging Face
``LlamaForCausalLM`` directory (``hf.py``).
"""
from __future__ import annotations

import os

from recipes.gpt2.data.tokenizer import TOKENIZER_FILE
from recipes.gpt2.recipe import GPT2Recipe
from recipes.hf_files import tensor_problems
from toolkit.recipe import Recipe

from . import config, hf
from .model import LlamaConfig, LlamaForCausalLM
from .plan import ACT_SBP, DATA_SBP, PIPELINE, TIED, mesh_plan


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

    def tied_pairs(self, model_cfg) -> tuple:
        """The LM head and the embedding, one parameter, with ``model.tie_word_embeddings``."""
        return TIED if model_cfg.get("tie_word_embeddings", False) else ()

    def check(self, cfg, layout) -> list:
        tokenizer = self.tokenizer_path(cfg)
        p = config.problems(cfg, layout, trains_tokenizer=tokenizer is None)
        weights = self.weights_path(str(cfg.trainer.init_from)) if cfg.trainer.init_from else None
        if tokenizer is None and weights is not None and self.reads_weights(weights):
            # Many Llama repositories ship sentencepiece's tokenizer.model alone: a tokenizer trained on the
            # corpus would give ids the pretrained embedding does not mean.
            p.append(f"trainer.init_from={cfg.trainer.init_from!r}: {weights} has no {TOKENIZER_FILE}, and a "
                     "tokenizer trained on the corpus would not have its token ids; valid: data.tokenizer=<the "
                     f"{TOKENIZER_FILE} its weights were trained with> (transformers' fast tokenizer file)")
        return p

    def n_layers(self, model_cfg) -> int:
        return int(model_cfg.num_hidden_layers)

    def build_model(self, model_cfg) -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig(**config.llama_config_kwargs(model_cfg)))

    def mesh_plan(self, cfg) -> dict:
        m = cfg.model
        return mesh_plan(bool(cfg.parallel.sequence_parallel), bool(m.get("qkv_bias", False)),
                         int(m.get("num_local_experts", 0)) > 0, int(m.get("shared_expert_intermediate_size", 0)) > 0,
                         bool(m.get("qk_norm", False)) and m.get("qk_norm_over", "head") == "projection",
                         bool(m.get("post_norm", False)))

    def flops_per_item(self, cfg, n_params: int) -> float:
        """Training FLOPs per token: 6 per parameter of the matmuls a token runs (the embedding is a lookup; of
        the experts, those it is routed to), plus
        attention's scores and weighted sum, 6 * 2 * layers * seq * heads * head_dim (half of it under the causal
        mask is still computed)."""
        m = cfg.model
        # A tied embedding is counted once in n_params, as the LM head's matmul.
        matmuls = n_params - (0 if m.get("tie_word_embeddings", False) else m.vocab_size * m.hidden_size)
        experts = m.get("num_local_experts", 0)
        if experts:  # model FLOPs count the routed work (num_experts_per_tok experts per token), not the slots
            idle = experts - m.num_experts_per_tok
            matmuls -= m.num_hidden_layers * idle * 3 * m.intermediate_size * m.hidden_size
        width = m.num_attention_heads * (m.get("head_dim", 0) or m.hidden_size // m.num_attention_heads)
        return 6.0 * matmuls + 12.0 * m.num_hidden_layers * int(cfg.data.seq_len) * width

    def weights_path(self, init_from: str) -> str | None:
        """A path, or a Hugging Face model's name (``TinyLlama/TinyLlama_v1.1``) in the local hub cache."""
        from recipes.gpt2.hf import hub_dir

        path = Recipe.weights_path(self, init_from)
        if path is None and "/" in init_from and not os.path.isabs(os.path.expanduser(init_from)):
            path = hub_dir(init_from)
        return path

    def reads_weights(self, path: str) -> bool:
        from recipes.gpt2.hf import is_hf_dir

        return is_hf_dir(path)

    def weights_problems(self, path: str, cfg) -> list:
        """``config.json`` against ``model.*``, then every tensor's name and shape from the files' headers."""
        return hf.hf_dir_problems(path, cfg.model) or tensor_problems(hf.ShardReader, self, path, cfg)

    def init_weights(self, model, path: str, cfg) -> bool:
        if not self.reads_weights(path):
            return False
        # build_stage left the parameters on the meta device: distribute_module builds each rank's shards, read
        # from the files box by box, so no rank reads the whole checkpoint.
        hf.read_weights_from(model, path, cfg.model)
        return True

    def resume_facts(self, cfg) -> dict:
        """Whether the LM head is the embedding: a tied run's checkpoint holds one tensor (and one optimizer
        state) under both names, which an untied model would read as two equal ones."""
        return {"model.tie_word_embeddings": bool(cfg.model.get("tie_word_embeddings", False))}

    def extra_state(self, cfg) -> dict:
        return {"model_config": config.llama_config_kwargs(cfg.model)}


RECIPE = LlamaRecipe()
