"""The runtime's point-to-point transfers on a GPU run on a stream of their thread's own and return done.

Under NCCL a transfer's ``wait`` only makes the current stream wait, so a
receive posted ahead of its data on the default stream would hold up every
kernel queued after it (``collectives._settled``). Two GPUs would show the
deadlock itself; one shows the contract: inside the block the current
stream is the thread's own, and on return what the block queued is done.
"""
from __future__ import annotations

import threading

import pytest
import torch

from sbp_core.boxing.collectives import _settled


def test_a_transfer_off_cuda_runs_on_the_current_stream_unchanged():
    with _settled(torch.device("cpu")):
        x = torch.ones(3) * 2
    assert x.sum() == 6


@pytest.mark.cuda
def test_a_transfer_on_cuda_has_its_threads_own_stream_and_is_done_on_return():
    device = torch.device("cuda", torch.cuda.current_device())
    default = torch.cuda.default_stream(device)
    x = torch.randn(2048, 2048, device=device)
    seen = {}

    def transfer(name):
        with _settled(device):
            seen[name] = torch.cuda.current_stream(device)
            y = x @ x @ x
        seen[name + " done"] = seen[name].query()
        seen[name + " y"] = y

    transfer("main")
    t = threading.Thread(target=transfer, args=("other",))
    t.start()
    t.join()
    assert seen["main"] != default and seen["other"] != default and seen["main"] != seen["other"]
    assert seen["main done"] and seen["other done"]
    assert torch.cuda.current_stream(device) == default
    torch.testing.assert_close(seen["main y"], seen["other y"])
