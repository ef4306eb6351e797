"""The launched paths on loopback: two torchrun node agents, and two simulated ``srun`` tasks.

Each "node" is a separate process tree that only shares the master address
and port, which is exactly what separates real nodes; both run a tiny script
that calls ``launch()`` and writes the all-reduced value and rank 0's config.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from toolkit.rank_pool import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = f'''
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
import torch.distributed as dist
from toolkit.launcher import launch


def main(cfg):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(os.path.join(cfg["out"], f"rank{{dist.get_rank()}}.txt"), "w") as f:
        f.write(f"{{t.item()}} {{dist.get_world_size()}} {{cfg['tag']}} {{os.environ['SBP_TIMEOUT']}}")


if __name__ == "__main__":
    # Every node passes its own tag; rank 0's config must reach all ranks.
    launch(main, {{"out": sys.argv[1], "tag": sys.argv[2]}}, nprocs=2, timeout=30)
'''
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _finish(procs, out: Path) -> list[str]:
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    return [(out / f"rank{r}.txt").read_text() for r in range(2)]


def test_torchrun_two_nodes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script), str(tmp_path), f"node{node}"],
        env=_clean_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(2)]
    assert _finish(procs, tmp_path) == ["3.0 2 node0 30.0"] * 2


def test_srun_two_tasks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for task in range(2):
        env = _clean_env()
        env.update(SLURM_PROCID=str(task), SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
                   SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="42", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), f"task{task}"], env=env,
                                      cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert _finish(procs, tmp_path) == ["3.0 2 task0 30.0"] * 2
