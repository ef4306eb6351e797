"""Does a CUDA job of ours start on this machine? One rank joins NCCL as every CUDA job does first.

    python scripts/nccl_check.py            # one CUDA device; exits 2 where there is none

Runs ``toolkit.launcher.launch`` with ``device="cuda"`` on one rank: a
TCP store, ``init_process_group("nccl")`` and the all-reduce that builds
the world's communicator (``launcher._join``), then a second all-reduce
whose value it checks. Even one GPU needs this: the job's device is the
world group's backend (``process_groups.world_device``). Prints ``nccl: ok``
with torch's and NCCL's versions and the seconds it took, or ``nccl: failed``
with the error, and exits 0 or 1. ``.ci/gpu`` runs it first and, where it
fails, once more with ``NCCL_CUMEM_ENABLE=0`` (NCCL's allocations through
the CUDA driver's virtual memory calls, which a sandboxed driver may refuse).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch


def _all_reduce(_cfg) -> str:
    import torch.distributed as dist

    t = torch.full((4,), 3.0, device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t)
    if t.tolist() != [3.0] * 4:
        raise RuntimeError(f"a one-rank all-reduce of 3.0 gave {t.tolist()}")
    return ".".join(map(str, torch.cuda.nccl.version()))


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("nccl: no CUDA device here (torch.cuda.is_available() is False); nothing was run")
        return 2
    try:
        from toolkit.launcher import launch
    except ImportError as e:  # not NCCL's fault: a retry with other NCCL settings would not help
        print(f"nccl: cannot import the launcher ({type(e).__name__}: {e}); nothing was run (are hydra-core "
              "and omegaconf installed? .ci/gpu's usage says how)")
        return 3

    cumem = os.environ.get("NCCL_CUMEM_ENABLE", "unset")
    start = time.perf_counter()
    try:
        version = launch(_all_reduce, {}, 1, device="cuda", timeout=120)
    except Exception as e:  # the error is the result
        traceback.print_exc()
        print(f"nccl: failed after {time.perf_counter() - start:.1f} s (NCCL_CUMEM_ENABLE={cumem}): "
              f"{type(e).__name__}: {e}")
        return 1
    print(f"nccl: ok, torch {torch.__version__}, NCCL {version}, {torch.cuda.get_device_name()}, "
          f"{time.perf_counter() - start:.1f} s (NCCL_CUMEM_ENABLE={cumem})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
