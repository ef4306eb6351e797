"""The GPT-2 recipe: the model, its token data, its plan and its pipeline split, for ``toolkit.trainer``."""
from __future__ import annotations

import math
import os

import torch
from omegaconf.errors import OmegaConfBaseException

from . import flops
from recipes.gpt2.data import prepare
from recipes.gpt2.data.tokenizer import TOKENIZER_FILE, tokenizer_of_weights
from toolkit.data import MicroBatches
from toolkit.recipe import Recipe

from . import config
from .model import GPT2Config, GPT2LMHeadModel
from .plan import ACT_SBP, DATA_SBP, PIPELINE, TIED, mesh_plan, stage_forward


class GPT2Recipe(Recipe):
    """Next-token prediction on a tokenized corpus; Megatron's layout in SBP (``plan.py``).

    One batch field, ``input_ids`` (``[seq_len]`` int64 per sample), read by
    the first stage (the tokens) and the last (the labels: GPT-2 shifts them).
    """

    name = "gpt2"
    model_schema = config.ModelConfig
    data_schema = config.DataConfig
    data_sbp = DATA_SBP
    act_sbp = ACT_SBP
    inputs = labels = ("input_ids",)
    pipeline = PIPELINE
    tied = tuple(TIED)
    throughput_unit = "tokens"
    sequence_parallel = True  # LayerNorm regions split along the sequence (plan.SEQUENCE_PARALLEL)
    context_dim = 1  # tokens [batch, seq], activations [batch, seq, hidden]: parallel.cp splits the sequence
    # Next-token cross-entropy over fixed-length rows: every row has the same targets (all but its last position).
    rows_weigh_equally = True

    def check(self, cfg, layout) -> list:
        return config.problems(cfg, layout, trains_tokenizer=self.tokenizer_path(cfg) is None)

    def n_layers(self, model_cfg) -> int:
        return int(model_cfg.n_layer)

    def build_model(self, model_cfg) -> GPT2LMHeadModel:
        return GPT2LMHeadModel(GPT2Config(**config.gpt2_config_kwargs(model_cfg)))

    def build_stage(self, model_cfg, cut) -> GPT2LMHeadModel:
        """Only this rank's shards are allocated: the model is built on the meta device and cut to the stage;
        its buffers get their values here, and its parameters stay on the meta device for
        ``distribute_module`` to build each rank's shard of them (``GPT2LMHeadModel.init_shard``: the
        values the whole model has, each drawn from the seed and its name alone)."""
        with torch.device("meta"):
            model = cut(self.build_model(model_cfg))
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = torch.empty_like(buf, device="cpu")
        model.reset_buffers()
        return model

    def mesh_plan(self, cfg) -> dict:
        return mesh_plan(bool(cfg.parallel.sequence_parallel))

    def stage_forward(self, module, x, labels=None):
        return stage_forward(module, x, labels)

    def batch_fields(self, cfg) -> dict:
        return {"input_ids": ((int(cfg.data.seq_len),), torch.int64)}

    def prepare(self, cfg):
        """The tokenizer and the train/validation token files (built once, cached, safe under concurrent ranks)."""
        d = cfg.data
        return prepare(d.path if d.source == "text" else d.source, int(d.vocab_size), int(d.seq_len),
                       float(d.val_fraction), os.path.expanduser(str(d.cache_dir)), max_bytes=d.max_bytes,
                       seed=int(cfg.trainer.seed), tokenizer=self.tokenizer_path(cfg), text_field=d.text_field)

    def tokenizer_path(self, cfg) -> str | None:
        """``data.tokenizer``; without it, under ``trainer.resume=auto`` with a checkpoint to continue, the
        run's own copy (``on_start`` keeps one in the run directory), else the tokenizer
        ``trainer.init_from``'s weights were trained with (``tokenizer_of_weights``): a new one's ids would
        not be the weights' (one trained on another corpus, as after a change of ``data.path``, has other
        ids). ``None``: train one."""
        if cfg.data.tokenizer is not None:
            return cfg.data.tokenizer
        if cfg.trainer.resume == "auto":
            from toolkit.checkpoint import latest
            from toolkit.run_state import checkpoint_root

            try:
                run_dir = str(cfg.run_dir)
            except (OmegaConfBaseException, ValueError):  # a run directory Hydra has not resolved here
                run_dir = None
            kept = os.path.join(run_dir, TOKENIZER_FILE) if run_dir else ""
            # Only with weights to continue: a run that stopped before its first checkpoint starts afresh.
            if os.path.isfile(kept) and latest(checkpoint_root(run_dir)) is not None:
                return kept
        if not cfg.trainer.init_from:
            return None
        weights = self.weights_path(str(cfg.trainer.init_from))
        return tokenizer_of_weights(weights) if weights else None

    def data(self, cfg, prepared, split: str, shard: int, n_shards: int, layout):
        if split == "val" and not prepared.n_val_sequences:
            return None
        return MicroBatches.from_prepared(prepared, split, layout.global_batch_size, int(cfg.trainer.seed),
                                          layout.accumulation, n_shards, shard)

    def items_per_sample(self, cfg) -> int:
        return int(cfg.data.seq_len)

    def evaluate(self, job) -> dict | None:
        """The validation loss and its perplexity, ``exp(val_loss)``."""
        out = super().evaluate(job)
        if out is not None and out["val_loss"] is not None:
            loss = float(out["val_loss"])
            out["val_ppl"] = math.exp(loss) if loss < 700 else float("inf")
        return out

    def flops_per_item(self, cfg, n_params: int) -> float:
        return flops.model_flops_per_token(cfg.model, int(cfg.data.seq_len), n_params=n_params)

    def weights_path(self, init_from: str) -> str | None:
        """A path, or a published GPT-2's name (``gpt2``, ``gpt2-medium``, ...) in the local hub cache."""
        from recipes.gpt2.hf import hub_dir

        path = super().weights_path(init_from)
        if path is None and init_from in config.HF_GPT2_DIMS:
            path = hub_dir(f"openai-community/{init_from}") or hub_dir(init_from)
        return path

    def reads_weights(self, path: str) -> bool:
        from recipes.gpt2.hf import is_hf_dir

        return is_hf_dir(path)

    def weights_problems(self, path: str, cfg) -> list:
        """``config.json`` against ``model.*``, then every tensor's name and shape from the files' headers (a meta
        model's parameters against them, nothing read)."""
        from recipes.gpt2.hf import ShardReader, hf_dir_problems
        from recipes.hf_files import tensor_problems

        return hf_dir_problems(path, cfg.model) or tensor_problems(ShardReader, self, path, cfg)

    def init_weights(self, model, path: str, cfg) -> bool:
        from recipes.gpt2.hf import read_weights_from

        if not self.reads_weights(path):
            return False
        # build_stage left the parameters on the meta device: distribute_module builds each rank's shards, read
        # from the files box by box, so no rank reads the whole checkpoint.
        read_weights_from(model, path, cfg.model)
        return True

    def extra_state(self, cfg) -> dict:
        return {"model_config": config.gpt2_config_kwargs(cfg.model)}  # convert_hf.py export reads it

    def on_start(self, job) -> None:
        """Say which tokenizer fine-tuning uses; a copy of the run's tokenizer in the run directory
        (``generate.py`` reads it)."""
        cfg = job.cfg
        given = self.tokenizer_path(cfg) if cfg.data.tokenizer is None else None
        dst = os.path.abspath(os.path.join(str(cfg.run_dir), TOKENIZER_FILE))
        if given is not None and os.path.abspath(given) == dst:
            print(f"tokenizer: the run's own ({given}), trainer.resume=auto", flush=True)
        elif cfg.trainer.init_from and cfg.data.tokenizer is None:
            print(f"tokenizer: {given}, trainer.init_from's" if given else
                  f"tokenizer: trainer.init_from={cfg.trainer.init_from!r} has no {TOKENIZER_FILE} beside it, so "
                  f"one was trained on the corpus ({job.data.tokenizer_path}); its ids match the weights' only if "
                  "they were trained with the same one: set data.tokenizer", flush=True)
        src = job.data.tokenizer_path
        if os.path.abspath(src) != dst:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(src, "rb") as f, open(dst + ".tmp", "wb") as g:
                g.write(f.read())
            os.replace(dst + ".tmp", dst)


RECIPE = GPT2Recipe()
