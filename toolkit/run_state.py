"""A training job's state in checkpoints: what is saved, resuming, and starting from weights.

Saved (``toolkit.checkpoint``, sharded, every rank its own boxes): this
rank's stage's parameters (global tensors: any layout reads them back),
AdamW state keyed by parameter name, the LR schedule, the sampler position
(the step: batches are a function of ``(seed, step)``), per-rank RNG states
and the step. Checkpoints live in ``<run_dir>/checkpoints/step_<N>``;
``trainer.resume=auto`` continues from the newest complete one, in any
layout. ``trainer.init_from`` starts from weights only: one of our
checkpoints, or a Hugging Face GPT-2 directory (``config.json`` +
safetensors/bin), read into the full model before it is split and laid out.
"""
from __future__ import annotations

import os

import torch

from toolkit import checkpoint as ckpt
from toolkit.checkpoint.hf_gpt2 import from_hf, read_hf_dir
from toolkit.config import gpt2_config_kwargs


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(str(run_dir), "checkpoints")


def _state(job, step: int) -> dict:
    return {
        "model": job.module.state_dict(),
        "optim": ckpt.optimizer_state_dict(job.optimizer, job.module),
        "scheduler": job.scheduler.state_dict(),
        "sampler": {"step": step, "seed": int(job.cfg.trainer.seed)},
        "step": step,
        "rng": ckpt.rng_state(),
        "extra": {"model_config": gpt2_config_kwargs(job.cfg.model)},  # convert_hf.py export reads it
    }


def save(job, step: int) -> str:
    """Every rank: checkpoint ``step`` under the run directory (keeps ``trainer.keep_last``)."""
    return ckpt.save(checkpoint_root(job.cfg.run_dir), step, _state(job, step),
                     keep_last=int(job.cfg.trainer.keep_last), tied=job.recipe.tied)


def resume(job) -> int:
    """Every rank: load the newest checkpoint of the run (if any); returns the step to continue from."""
    path = ckpt.latest(checkpoint_root(job.cfg.run_dir))
    if path is None:
        return 0
    template = {**_state(job, 0), "scheduler": None, "sampler": None, "step": None, "rng": None, "extra": None}
    out = ckpt.load(path, template, tied=job.recipe.tied)
    ckpt.load_optimizer_state_dict(job.optimizer, job.module, out["optim"])
    job.scheduler.load_state_dict(out["scheduler"])
    ckpt.set_rng_state(out["rng"])
    _refresh(job)
    return int(out["step"])


def _refresh(job) -> None:
    if getattr(job, "zero", None) is not None:  # compute copies from the loaded masters
        job.zero.refresh()


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "manifest.json"))


def load_hf_into(model, path: str, model_cfg) -> None:
    """Copy a Hugging Face GPT-2 directory's weights into the full (not yet split) ``model``."""
    config, hf_sd = read_hf_dir(path)
    ours = {k: int(model_cfg[k]) for k in ("n_embd", "n_head", "n_layer", "vocab_size", "n_positions")}
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        if int(config.get(key, -1)) != int(model_cfg[key]):
            raise ValueError(f"trainer.init_from={path}: its {key}={config.get(key)} but model.{key}="
                             f"{model_cfg[key]}; choose the model preset that matches it")
    state = from_hf(hf_sd, ours)
    with torch.no_grad():
        missing = model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    if missing.missing_keys:
        raise ValueError(f"trainer.init_from={path}: no weights for {missing.missing_keys[:5]}")


def load_weights(job, path: str) -> None:
    """Every rank: this rank's stage parameters from our checkpoint at ``path`` (any saved layout)."""
    ckpt.load(path, {"model": job.module.state_dict()}, tied=job.recipe.tied)
    _refresh(job)


def write_tokenizer(job) -> None:
    """Rank 0: a copy of the run's tokenizer in the run directory (``generate.py`` reads it)."""
    src = job.data.tokenizer_path
    dst = os.path.join(str(job.cfg.run_dir), "tokenizer.json")
    if os.path.abspath(src) != os.path.abspath(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(src, "rb") as f, open(dst + ".tmp", "wb") as g:
            g.write(f.read())
        os.replace(dst + ".tmp", dst)
