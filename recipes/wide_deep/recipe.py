"""The Wide&Deep recipe: Criteo-layout click prediction with vocabulary- and column-split tables.

Fields of a batch (``data_sbp = (S(0), S(0))``: one shard per rank of the
stage): ``dense`` ``[13]`` float32, ``ids`` ``[26]`` int64 (hashed table
rows), both read by the model, and ``label`` (float32 0/1), read by the
loss (sigmoid BCE). The plan (``plan.py``) splits the tables over every
rank and keeps the MLP data parallel; there is no pipeline split
(``pp > 1`` is refused). The optimizer is ``LazyAdamW`` (``optim.py``);
evaluation is the exact AUC and log loss of the held-out split
(``evaluate.py``), with the Bayes AUC of the planted model on synthetic
data.
"""
from __future__ import annotations

import torch

from toolkit.data import GlobalBatchSampler, MicroBatches
from toolkit.recipe import Recipe

from . import config
from .data import open_splits
from .evaluate import evaluate
from .features import N_DENSE, N_FIELDS
from .model import WideDeep, bce_loss
from .optim import build_optimizer
from .plan import DATA_SBP, mesh_plan


class WideDeepRecipe(Recipe):
    name = "wide_deep"
    model_schema = config.ModelSchema
    data_schema = config.DataSchema
    data_sbp = DATA_SBP
    inputs = ("dense", "ids")
    labels = ("label",)
    pipeline = None
    throughput_unit = "samples"
    rows_weigh_equally = True  # binary cross-entropy, the mean over samples

    def check(self, cfg, layout) -> list:
        out = super().check(cfg, layout) + config.problems(cfg.model, cfg.data)
        if layout.zero:
            out.append(f"parallel.zero={layout.zero}: wide_deep's tables are already split over every rank and "
                       "its optimizer keeps lazy row state; valid: parallel.zero=0")
        if cfg.trainer.optimizer != "adamw":
            out.append(f"trainer.optimizer={cfg.trainer.optimizer!r}: wide_deep trains with LazyAdamW (AdamW on "
                       "the MLP, lazy Adam on the tables); valid: adamw")
        if cfg.trainer.precision != "fp32":
            out.append(f"trainer.precision={cfg.trainer.precision!r}: wide_deep runs in fp32; valid: fp32")
        if cfg.trainer.activation_checkpointing:
            out.append("trainer.activation_checkpointing=true: wide_deep has no repeated layers to recompute; "
                       "valid: false")
        batch = int(cfg.trainer.global_batch_size)
        if cfg.data.source == "synthetic" and batch > int(cfg.data.train_rows):
            out.append(f"trainer.global_batch_size={batch}: more than data.train_rows={cfg.data.train_rows}; valid: "
                       f"at most {cfg.data.train_rows}, or data.train_rows >= {batch}")
        ranks = layout.dp * layout.tp
        if not config.problems(cfg.model, cfg.data) and config.table_rows(cfg.model) < ranks:
            out.append(f"model: {config.table_rows(cfg.model)} table rows for {ranks} ranks of a stage: every rank "
                       "needs at least one vocabulary row (raise model.vocab_size)")
        return out

    def build_model(self, model_cfg) -> WideDeep:
        """The tables on the meta device: ``distribute_module`` builds each rank's shard alone."""
        return WideDeep(config.model_config(model_cfg, meta_tables=True))

    def mesh_plan(self, cfg) -> dict:
        return mesh_plan(cfg)

    def stage_forward(self, module, x, labels=None):
        return bce_loss(module(x["dense"], x["ids"]), labels["label"])

    def build_optimizer(self, module, cfg):
        return build_optimizer(module, cfg.trainer, dense_table_state=bool(cfg.model.dense_table_state))

    def batch_fields(self, cfg) -> dict:
        return {"dense": ((N_DENSE,), torch.float32), "ids": ((N_FIELDS,), torch.int64), "label": ((), torch.float32)}

    def prepare(self, cfg):
        return open_splits(cfg.data, cfg.model)

    def data(self, cfg, prepared, split: str, shard: int, n_shards: int, layout):
        if split != "train":
            return None  # evaluation scores the held-out rows itself (every row, not batches of them)
        rows = prepared.train
        sampler = GlobalBatchSampler(len(rows), layout.global_batch_size, int(cfg.trainer.seed))
        return MicroBatches(rows, sampler, layout.accumulation, n_shards, shard)

    def evaluate(self, job) -> dict | None:
        d = job.cfg.data
        val = job.data.val
        n = len(val) if d.eval_rows is None else min(int(d.eval_rows), len(val))
        return evaluate(job.module, val, job.placements[job.stage], self.data_sbp, n, int(d.eval_batch),
                        job.data.bayes)

    def flops_per_item(self, cfg, n_params: int) -> float:
        """6 x the MLP's multiply-adds per sample (forward and backward); lookups and the wide sum are noise."""
        width, macs = N_DENSE + N_FIELDS * int(cfg.model.embed_dim), 0
        for h in [int(h) for h in cfg.model.hidden] + [1]:
            macs += width * h
            width = h
        return 6.0 * macs

    def extra_state(self, cfg) -> dict:
        return {"table_rows": config.table_rows(cfg.model), "hash_seed": int(cfg.model.hash_seed)}

    def resume_facts(self, cfg) -> dict:
        """How ids become table rows: the hash seed, and one shared vocabulary or one per field (as many
        rows in all hash otherwise; the total is the table's shape, checked apart)."""
        return {"model.hash_seed": cfg.model.hash_seed, "model.field_vocab_sizes": cfg.model.field_vocab_sizes}

    def on_start(self, job) -> None:
        print(f"wide_deep data: {len(job.data.train)} train rows, {len(job.data.val)} held out; {job.data.summary}",
              flush=True)


RECIPE = WideDeepRecipe()
