"""A training job's state in checkpoints: what is saved, resuming, and starting from weights.

Saved (``toolkit.checkpoint``, sharded, every rank its own boxes): this
rank's stage's parameters (global tensors: any layout reads them back),
AdamW state keyed by parameter name, the LR schedule, the sampler position
(the step: batches are a function of ``(seed, step)``), per-rank RNG states
(CPU and, on CUDA, this rank's device), fp16's loss scale, the step and the
recipe's ``resume_facts`` (a resume under others is refused before
spawning). Checkpoints live in ``<run_dir>/checkpoints/step_<N>``;
``trainer.resume=auto`` continues from the newest complete one, in any
layout, under the config's optimizer hyper-parameters and schedule (a
changed ``trainer.lr`` or ``max_steps`` applies from the step resumed:
``toolkit.optim.follow_config``; rank 0 reports the changes) and data seed
(a change warns before spawning). ``trainer.init_from`` starts from weights only: one of our
checkpoints (here), or a format the recipe reads into the full model before
it is split and laid out (``Recipe.init_weights``, e.g. a Hugging Face GPT-2
directory).
"""
from __future__ import annotations

import os

import sbp_core as sc
from toolkit import checkpoint as ckpt
from toolkit.checkpoint import rng
from toolkit.checkpoint._dist import agree
from toolkit.optim import follow_config, settings


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
        "extra": job.recipe.extra_state(job.cfg),
        "facts": resume_facts(job.recipe, job.cfg),
        "loss_scale": job.pipe.loss_scale.state_dict() if job.pipe.loss_scale is not None else None,
    }


def save(job, step: int) -> str:
    """Every rank: checkpoint ``step`` under the run directory (keeps ``trainer.keep_last``).

    Under ``SBP_INIT_TIMEOUT``: ranks wait for the slowest writer and for rank 0's publishing, which a
    large state on a slow file system can keep past ``SBP_TIMEOUT``."""
    with sc.initialising():
        return ckpt.save(checkpoint_root(job.cfg.run_dir), step, _state(job, step),
                         keep_last=int(job.cfg.trainer.keep_last), tied=job.recipe.tied_pairs(job.cfg.model))


def resume(job) -> int:
    """Every rank: load the newest checkpoint of the run (if any); returns the step to continue from.
    Rank 0 says which it loaded, or that there was none (a new run directory: ``hydra.run.dir`` names
    the old one)."""
    root = checkpoint_root(job.cfg.run_dir)
    path = latest_on_every_rank(root)
    if path is None:
        if job.rank == 0:
            print(f"trainer.resume=auto: no complete checkpoint under {root}; starting from step 0 (to continue "
                  "a run, give its directory: hydra.run.dir=<run dir>)", flush=True)
        return 0
    wrong = facts_problems(ckpt.plain_value(path, "facts"), resume_facts(job.recipe, job.cfg), path)
    if wrong:  # validate refused these before spawning, unless this job was laid out without resuming
        raise ckpt.CheckpointError("; ".join(wrong))
    template = {**_state(job, 0), "scheduler": None, "sampler": None, "step": None, "rng": None, "extra": None,
                "facts": None, "loss_scale": None}
    out = ckpt.load(path, template, tied=job.recipe.tied_pairs(job.cfg.model))
    built = settings(job.optimizer)
    ckpt.load_optimizer_state_dict(job.optimizer, job.module, out["optim"])
    job.scheduler.load_state_dict(out["scheduler"])
    changed = follow_config(job.optimizer, job.scheduler, built)
    if changed and job.rank == 0:
        print("resume: the config's optimizer settings apply, not the checkpoint's: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed), flush=True)
    ckpt.set_rng_state(out["rng"])
    ranks = job.placements[job.stage].ranks
    if rng.agree_within(ranks) and job.rank == min(ranks):
        print(f"resume: ranks {sorted(ranks)} (a stage's placement) restored different random states (a checkpoint "
              f"saved in another layout); each takes rank {min(ranks)}'s", flush=True)
    if out.get("loss_scale") and job.pipe.loss_scale is not None:  # fp16 resumes its scale
        job.pipe.loss_scale.load_state_dict(out["loss_scale"])
    _refresh(job)
    step = int(out["step"])
    if job.rank == 0:
        print(f"resumed from step {step} ({path})", flush=True)
    return step


def resume_facts(recipe, cfg) -> dict:
    """``recipe.resume_facts(cfg)`` as plain data (config nodes as lists and dicts), the form it is saved in;
    ``TypeError`` naming the value that a checkpoint cannot hold."""
    import json

    from omegaconf import OmegaConf

    facts = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
             for k, v in recipe.resume_facts(cfg).items()}
    try:
        json.dumps(facts)
    except (TypeError, ValueError) as err:
        raise TypeError(f"recipe {recipe.name}'s resume_facts must be JSON data (numbers, strings, None, lists, "
                        f"dicts): {err}") from None
    return facts


def facts_problems(saved, now: dict, path: str) -> list:
    """Each of ``now``'s facts that checkpoint ``path`` was saved with another value of (``saved``: its
    ``facts``, ``None`` for a checkpoint saved before facts were: nothing to compare)."""
    saved = saved or {}
    return [f"trainer.resume=auto: {key}={value!r} here, the run's newest checkpoint ({path}) was saved with "
            f"{key}={saved[key]!r}, and what it holds means something only under that value; valid: "
            f"{key}={saved[key]!r}, or another run directory (hydra.run.dir)"
            for key, value in now.items() if key in saved and saved[key] != value]


def latest_on_every_rank(root: str) -> str | None:
    """``ckpt.latest(root)`` as every rank sees it, the same on all (collective over the world).

    Each rank looks at its own view of the directory; ranks that disagree
    (a run directory that is not one filesystem for every node, or a stale
    network-filesystem cache) would split into ranks that load, and enter
    the load's collectives, and ranks that start afresh: a hang. They raise
    ``CheckpointError`` instead, on every rank, naming what each saw."""
    seen = agree(ckpt.latest, root)
    if len(set(seen)) > 1:
        views = ", ".join(f"rank {r}: {os.path.basename(p) if p else 'none'}" for r, p in enumerate(seen))
        raise ckpt.CheckpointError(f"trainer.resume=auto: the ranks see different newest checkpoints under {root} "
                                   f"({views}); every rank must see one run directory (a filesystem shared "
                                   "by every node)")
    return seen[0]


def _refresh(job) -> None:
    if getattr(job, "zero", None) is not None:  # compute copies from the loaded masters
        job.zero.refresh()


def load_weights(job, path: str) -> None:
    """Every rank: this rank's stage parameters from our checkpoint at ``path`` (any saved layout)."""
    ckpt.load(path, {"model": job.module.state_dict()}, tied=job.recipe.tied_pairs(job.cfg.model))
    _refresh(job)
