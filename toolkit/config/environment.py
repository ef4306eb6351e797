"""How many processes a job has and where it runs: torchrun's and Slurm's environment, device kind.

A job is either *launched* (torchrun, or ``srun`` under Slurm, started one
process per rank and told each its rank through the environment) or *local*
(``train.py`` will spawn ``dp * cp * tp * pp`` processes itself). :func:`cluster_env`
tells which, and both :func:`toolkit.config.validate` (world-size check) and
:func:`toolkit.launcher.launch` (process-group init) read it, so they agree.

torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` all set (``LOCAL_WORLD_SIZE`` optional).

Slurm (``srun``): ``SLURM_PROCID``, ``SLURM_LOCALID`` and
``SLURM_STEP_NUM_TASKS``. The step's task count is used, not
``SLURM_NTASKS``: an ``sbatch`` script that runs ``python train.py`` without
``srun`` sees ``SLURM_NTASKS`` of the allocation but is one process, which then
spawns locally. A one-task step (``srun --pty bash``) also counts as local.
The master is ``MASTER_ADDR`` if set, else the first host of
``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``; the
port is ``MASTER_PORT`` if set, else ``20000 + SLURM_JOB_ID % 10000`` (the
same on every task of a job, different between most concurrent jobs).
With ``--gpus-per-task`` (``SLURM_GPUS_PER_TASK``) each task sees only its
own devices, so a rank needs one visible device, not one per local rank;
otherwise each node needs a device per task of the busiest node
(``SLURM_STEP_TASKS_PER_NODE``, which srun always sets).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from toolkit.config.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in a launched job."""

    kind: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]  # None when the launcher does not say
    master_addr: str
    master_port: int
    gpu_per_task: bool = False  # Slurm binds devices to each task (--gpus-per-task): a rank sees its own only

    def sharing_devices(self, world: int) -> int:
        """How many ranks need a device of their own among those this process sees: 1 where Slurm binds
        devices to each task, else the node's ranks (``world`` where the launcher does not say).
        ``validate`` and the launcher both resolve ``device=auto`` with it, so they agree."""
        return 1 if self.gpu_per_task else self.local_world_size or world


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment {key}={env[key]!r}: not an integer; valid: a decimal integer "
                          "as set by torchrun or Slurm") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``"gpu[07-09,11],cpu1"`` -> ``"gpu07"``.

    Each bracket expression is replaced by its first value, so multi-bracket
    names (``"r[1-2]n[03-04]"`` -> ``"r1n03"``) work as well.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first entry
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], entry)
    if not host or "[" in host or "]" in host:
        raise ConfigError(f"SLURM nodelist {nodelist!r}: cannot read its first host; valid: "
                          "a Slurm hostlist such as 'node[01-04]' (or set MASTER_ADDR)")
    return host


def cluster_env(env: Mapping[str, str] | None = None) -> Optional[ClusterEnv]:
    """The launched job this process belongs to, or ``None`` when it runs on its own.

    ``env`` defaults to ``os.environ``. torchrun's variables win over Slurm's
    (``srun torchrun ...`` sets both; torchrun's describe the workers).
    """
    env = os.environ if env is None else env
    if all(k in env for k in TORCHRUN_VARS):
        local_ws = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
        return ClusterEnv("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                          _int(env, "LOCAL_RANK"), local_ws, env["MASTER_ADDR"],
                          _int(env, "MASTER_PORT"))
    if all(k in env for k in SLURM_VARS) and _int(env, "SLURM_STEP_NUM_TASKS") > 1:
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                        or env.get("SLURM_NODELIST"))
            if not nodelist:
                raise ConfigError("Slurm step without a node list: set MASTER_ADDR, or run under srun "
                                  "(which sets SLURM_STEP_NODELIST)")
            addr = first_host(nodelist)
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = 20000 + _int(env, "SLURM_JOB_ID") % 10000 if "SLURM_JOB_ID" in env else 29500
        return ClusterEnv("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"),
                          _int(env, "SLURM_LOCALID"), _most_tasks_on_a_node(env), addr, port,
                          "SLURM_GPUS_PER_TASK" in env)
    return None


def _most_tasks_on_a_node(env: Mapping[str, str]) -> Optional[int]:
    """The most tasks any node of the step runs, from Slurm's per-node task counts (``None``: not said).

    ``SLURM_STEP_TASKS_PER_NODE`` (srun sets it for every step), else the
    allocation's ``SLURM_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``
    (set only under ``--ntasks-per-node``). Slurm writes them as ``"4"``,
    ``"4(x2)"`` (4 on each of 2 nodes) or ``"4(x2),2"``. The most, not this
    node's: every rank then decides alike whether each of a node's ranks
    has a GPU of its own.
    """
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        entries = env.get(key, "").split(",")
        counts = [re.fullmatch(r"(\d+)(?:\(x\d+\))?", e.strip()) for e in entries]
        if all(counts):
            return max(int(c.group(1)) for c in counts)
    return None


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA); imports torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a launched rank: its local rank, or 0 where the launcher shows each task one
    device (Slurm's ``--gpus-per-task=1``)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise ConfigError(f"local rank {local_rank} has no CUDA device of its own: {visible} visible; valid: "
                      f"at most {visible} ranks per node, or one visible device per task")


def resolve_device(device: str, local_ranks: int) -> str:
    """``"cpu"`` or ``"cuda"`` for ``device`` in auto/cpu/cuda and ``local_ranks`` processes on this node.

    ``auto`` is CUDA when there is a visible device for every local rank.
    ``cuda`` with too few devices raises :class:`ConfigError`.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r}: unknown device kind; valid: auto, cpu, cuda")
    if device == "cpu":
        return "cpu"
    count = cuda_device_count()
    if count >= local_ranks:
        return "cuda"
    if device == "cuda":
        fewer = f"a layout with at most {count} ranks per node, or " if count else ""
        raise ConfigError(f"device='cuda': {local_ranks} local ranks need as many visible CUDA devices, "
                          f"found {count}; valid: {fewer}device=cpu or device=auto")
    return "cpu"
