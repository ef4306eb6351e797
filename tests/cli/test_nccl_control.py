"""A whole training job as NCCL runs it, on CPU: gpt2 dp2_pp2 with an evaluation and checkpoints, the world
read as NCCL by ``sbp_core.process_groups`` alone while every group stays gloo on the host. Each group then gets
its gloo control twin on every rank (most groups leave a rank out), layout checks, headers, the checkpoint's
object collectives (its own and DCP's) and the runtime's tokens (one before each pipeline receive) go over the
twins, as on GPUs, and a checkpoint is written under the init bound; the losses, evaluation and checkpoint
must be the job's own, bit for bit."""
from __future__ import annotations

import json
import os

import torch
from omegaconf import OmegaConf

from tests.cli.pooled import _rank_train
from tests.cli.test_train_cli import TINY
from toolkit.config import compose, save_resolved_config, validate

JOB = [*TINY, "parallel=dp2_pp2", "trainer.eval_every=3", "trainer.eval_steps=1", "trainer.save_every=2"]


OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


def _train_as_nccl(container: dict):
    """Train; returns (how many twins this rank built, the object collectives that did not go over a twin,
    whether each checkpoint save ran under the init bound)."""
    from unittest import mock

    import torch.distributed as dist

    from sbp_core import process_groups
    from tests.as_nccl import world_read_as_nccl
    from toolkit import checkpoint

    off_twins, inits = [], []

    def on_twin(name):
        real = getattr(dist, name)

        def call(*args, group=None, **kwargs):
            twins = {id(twin) for _, twin in process_groups._twins.values()}
            if id(group) not in twins:
                off_twins.append(name)
            return real(*args, group=group, **kwargs)

        return call

    def save(*args, **kwargs):
        inits.append(process_groups._initialising > 0)
        return real_save(*args, **kwargs)

    real_save = checkpoint.save
    with world_read_as_nccl(), mock.patch.object(checkpoint, "save", save), \
            mock.patch.multiple(dist, **{name: on_twin(name) for name in OBJECT_COLLECTIVES}):
        _rank_train(container)
        return len(process_groups._twinned), off_twins, inits


def _rows(run_dir) -> list:
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "tflops", "mfu", "mem")}
                for line in f]


def test_a_job_under_nccls_control_messages_is_the_jobs_own(tmp_path, sbp_cache):
    from recipes.registry import get
    from toolkit import checkpoint as ckpt
    from toolkit.rank_pool import RankPool, get_pool

    runs = {}
    for way in ("gloo", "as_nccl"):
        run = tmp_path / way
        cfg = compose([*JOB, f"data.cache_dir={sbp_cache}"], run_dir=str(run))
        layout = validate(cfg, get(cfg.recipe.name))
        save_resolved_config(cfg, run)
        container = OmegaConf.to_container(cfg, resolve=True)
        if way == "gloo":
            get_pool(layout.world_size).run(_rank_train, container, call_timeout=600)
        else:
            with RankPool(layout.world_size, timeout=60.0) as pool:  # its own: the twins stay in its workers
                twins, off_twins, inits = zip(*pool.run(_train_as_nccl, container, call_timeout=180))
            assert len(set(twins)) == 1 and twins[0] > layout.world_size, twins
            assert off_twins == ([],) * layout.world_size, off_twins  # checkpoint and DCP messages included
            assert inits == ([True, True],) * layout.world_size, inits  # steps 2 and 3
        runs[way] = run
    assert _rows(runs["gloo"]) == _rows(runs["as_nccl"])
    assert any("val_loss" in r for r in _rows(runs["as_nccl"]))
    a, b = (ckpt.load(str(runs[w] / "checkpoints"), {"model": None})["model"] for w in ("gloo", "as_nccl"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
