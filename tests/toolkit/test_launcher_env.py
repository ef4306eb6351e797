"""Reading torchrun's and Slurm's environment (no processes started)."""
from __future__ import annotations

import pytest

from toolkit.config import ConfigError, cluster_env, resolve_device
from toolkit.config.environment import device_index, first_host

TORCHRUN = dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1",
                MASTER_PORT="29400")
SRUN = dict(SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_STEP_NUM_TASKS="8", SLURM_NTASKS="8",
            SLURM_STEP_NODELIST="gpu[07-09,11]", SLURM_JOB_ID="123456", SLURM_NTASKS_PER_NODE="2")


def test_not_launched():
    assert cluster_env({}) is None
    assert cluster_env({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}) is None


def test_torchrun():
    env = cluster_env(TORCHRUN)
    assert (env.kind, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 3, 8, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29400)


def test_torchrun_wins_over_slurm():
    assert cluster_env({**SRUN, **TORCHRUN}).kind == "torchrun"


def test_srun():
    env = cluster_env(SRUN)
    assert (env.kind, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 2)
    assert env.master_addr == "gpu07"
    assert env.master_port == 20000 + 123456 % 10000


def test_srun_tasks_per_node_in_slurms_repeated_form():
    assert cluster_env({**SRUN, "SLURM_NTASKS_PER_NODE": "2(x4)"}).local_world_size == 2
    assert cluster_env({**SRUN, "SLURM_NTASKS_PER_NODE": "2,1"}).local_world_size == 2  # the busiest node's


def test_srun_without_ntasks_per_node_reads_the_steps_tasks_per_node():
    """``srun -N2 -n16`` sets no ``SLURM_NTASKS_PER_NODE``; the step's per-node counts are always there."""
    plain = {k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert cluster_env(plain).local_world_size is None
    assert cluster_env({**plain, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}).local_world_size == 8
    assert cluster_env({**plain, "SLURM_TASKS_PER_NODE": "8(x2)"}).local_world_size == 8
    assert cluster_env({**plain, "SLURM_STEP_TASKS_PER_NODE": "3(x2),2", "SLURM_TASKS_PER_NODE": "4(x2)"}
                       ).local_world_size == 3  # the step's, not the allocation's
    assert cluster_env({**plain, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}).sharing_devices(16) == 8


def test_srun_gpus_per_task_gives_each_task_its_own_devices():
    assert not cluster_env(SRUN).gpu_per_task and cluster_env(SRUN).sharing_devices(8) == 2
    bound = cluster_env({**SRUN, "SLURM_GPUS_PER_TASK": "1"})
    assert bound.gpu_per_task and bound.sharing_devices(8) == 1
    assert cluster_env({**SRUN, "SLURM_NTASKS_PER_NODE": "2,1"}).sharing_devices(8) == 2  # the busiest node
    unsaid = {k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert cluster_env(unsaid).sharing_devices(8) == 8  # not said: all


def test_a_launched_ranks_device_is_its_local_rank_or_the_one_it_sees():
    assert device_index(3, 8) == 3 and device_index(3, 1) == 0  # --gpus-per-task=1 shows each task one
    with pytest.raises(ConfigError, match="local rank 3 has no CUDA device of its own: 2 visible"):
        device_index(3, 2)


def test_srun_master_from_environment():
    env = cluster_env({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("head", 1234)


def test_sbatch_script_without_srun_is_local():
    """The batch script sees the allocation's SLURM_NTASKS but is one process: spawn locally."""
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert cluster_env({**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) is None


def test_single_task_step_is_local():
    assert cluster_env({**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None


def test_bad_integer():
    with pytest.raises(ConfigError, match=r"RANK='zero': not an integer"):
        cluster_env({**TORCHRUN, "RANK": "zero"})


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"),
    ("node1,node2", "node1"),
    ("gpu[07-09,11]", "gpu07"),
    ("gpu[07-09,11],cpu[1-2]", "gpu07"),
    ("r[1-2]n[03-04]", "r1n03"),
    ("a-b-[3,5]", "a-b-3"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_first_host_malformed():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        first_host("gpu[07")


def test_resolve_device_on_cpu_machine():
    import torch

    assert resolve_device("cpu", 8) == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device("auto", 2) == "cpu"
        with pytest.raises(ConfigError, match="device=cpu"):
            resolve_device("cuda", 2)
    with pytest.raises(ConfigError, match="valid: auto, cpu, cuda"):
        resolve_device("gpu", 1)
