"""NCCL's control flow on CPU: the world's backend read as NCCL by ``sbp_core.process_groups`` alone.

Inside ``world_read_as_nccl()`` every group sbp_core builds gets its gloo control twin (on every rank of the
world), host messages go over the twins and each tensor receive waits for its sender's token, as under NCCL,
while every group (and torch itself) stays gloo and the job's device the host. Device transfers, streams
and events are not exercised: the data stays on gloo.
"""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch


class _WorldAsNccl:
    """``torch.distributed`` whose default backend reads ``nccl`` (a given group's reads its own)."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    def get_backend(self, group=None):
        import torch.distributed as dist

        return "nccl" if group is None else dist.get_backend(group)


@contextmanager
def world_read_as_nccl():
    import runtime.executor as executor
    from sbp_core import process_groups

    host = lambda: torch.device("cpu")  # noqa: E731  (the job's device, which NCCL's would be a GPU)
    with mock.patch.object(process_groups, "dist", _WorldAsNccl()), \
            mock.patch.object(process_groups, "world_device", host), mock.patch.object(executor, "world_device", host):
        yield
