"""``launch`` on this machine: in-process, spawned ranks, and failures that must not hang."""
from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import sbp_core.process_groups as sbp_groups  # imported before launch() sets SBP_TIMEOUT in children
from toolkit.config.schema import TrainConfig
from toolkit.launcher import LaunchError, launch

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")


@pytest.fixture(autouse=True)
def _local_environment(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def all_reduce_ranks(cfg):
    """Every rank contributes rank + 1; returns what rank 0 can check about its world and config."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SBP_TIMEOUT")}
    return dict(sum=t.item(), world=dist.get_world_size(), backend=dist.get_backend(), env=env,
                sbp_timeout=sbp_groups.get_timeout(),
                cfg_type=OmegaConf.get_type(cfg).__name__, dp=cfg.parallel.dp, run_dir=cfg.run_dir)


def _mark_failure(cfg):
    with open(os.path.join(cfg["dir"], "failed_at"), "w") as f:
        f.write(repr(time.time()))


def _seconds_since_failure(tmp_path) -> float:
    return time.time() - float((tmp_path / "failed_at").read_text())


def raise_on_rank_1(cfg):
    with open(os.path.join(cfg["dir"], f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 1:
        _mark_failure(cfg)
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits here for a peer that never comes


def exit_on_rank_1(cfg):
    with open(os.path.join(cfg["dir"], f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 1:
        _mark_failure(cfg)
        os._exit(3)
    time.sleep(600)  # not in a collective: only the parent can end this rank


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _typed_cfg(layout="dp2"):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.parallel.dp = int(layout[2:])
    cfg.run_dir = "${oc.env:SBP_TEST_RUN_DIR,/tmp/default}"  # resolved in the parent
    return cfg


def test_spawned_ranks_all_reduce(monkeypatch):
    nprocs = 2  # 16 spawned ranks: tests/cli/test_train_cli.py
    monkeypatch.setenv("SBP_TEST_RUN_DIR", "/tmp/from-parent")
    out = launch(all_reduce_ranks, _typed_cfg(f"dp{nprocs}"), nprocs, timeout=60)
    assert out["sum"] == nprocs * (nprocs + 1) / 2
    assert out["world"] == nprocs and out["backend"] == "gloo"
    assert out["env"]["RANK"] == "0" and out["env"]["WORLD_SIZE"] == str(nprocs)
    assert out["env"]["SBP_TIMEOUT"] == "60.0" and out["sbp_timeout"] == 60.0
    assert out["cfg_type"] == "TrainConfig" and out["dp"] == nprocs  # rebuilt typed
    assert out["run_dir"] == "/tmp/from-parent"
    assert "RANK" not in os.environ and not dist.is_initialized()


def test_single_rank_runs_in_process():
    before = sbp_groups.get_timeout()
    out = launch(all_reduce_ranks, _typed_cfg("dp1"), 1, timeout=30)
    assert out["sum"] == 1.0 and out["world"] == 1 and out["env"]["RANK"] == "0"
    assert out["sbp_timeout"] == 30.0 and sbp_groups.get_timeout() == before
    assert out["cfg_type"] == "TrainConfig"
    assert not dist.is_initialized()
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        assert key not in os.environ  # restored


def test_in_process_failure_propagates_and_cleans_up():
    with pytest.raises(KeyError):
        launch(lambda cfg: cfg["missing"], {}, 1, timeout=30)
    assert not dist.is_initialized() and "RANK" not in os.environ


def test_a_raising_rank_ends_every_rank_with_its_traceback(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank_1, {"dir": str(tmp_path)}, 2, timeout=120, kill_grace=2)
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom on rank 1" in str(err) and "Traceback" in str(err)
    assert "raise_on_rank_1" in err.failures[1]
    # Far below the 120 s collective timeout: rank 0 was stopped, not timed out.
    assert _seconds_since_failure(tmp_path) < 10
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert all(_gone(pid) for pid in pids)


def test_a_dying_rank_ends_every_rank(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(exit_on_rank_1, {"dir": str(tmp_path)}, 2, timeout=120, kill_grace=2)
    assert info.value.rank == 1
    assert "rank 1 died (exit code 3) without reporting an error" in str(info.value)
    assert _seconds_since_failure(tmp_path) < 10  # rank 0 sleeps 600 s unless stopped
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert all(_gone(pid) for pid in pids)


def test_main_must_be_picklable():
    with pytest.raises(TypeError, match="module-level function"):
        launch(lambda cfg: None, {}, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs=0"):
        launch(all_reduce_ranks, {}, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch(all_reduce_ranks, {}, 1, timeout=0)


def test_launch_error_pickles():
    err = LaunchError("x", 1, {1: "tb"})
    assert isinstance(pickle.loads(pickle.dumps(err)), RuntimeError)
