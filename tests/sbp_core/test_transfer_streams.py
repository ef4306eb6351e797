"""The runtime's point-to-point transfers on a GPU run on a stream of their thread's own and return done.

Under NCCL a transfer's ``wait`` only makes the current stream wait, so a
receive posted ahead of its data on the default stream would hold up every
kernel queued after it (``collectives._settled``). Two GPUs would show the
deadlock itself; one shows the contract: inside the block the current
stream is the thread's own, and on return what the block queued is done;
given a producer's ready mark, the transfer waits for that alone. Work of
another thread on a value (a pipeline boundary's cut) runs behind the
value's mark alone too (``after_marks``).
"""
from __future__ import annotations

import threading

import pytest
import torch

from sbp_core.boxing.collectives import _settled, after_marks, ready_mark


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



@pytest.mark.cuda
def test_a_cuda_tensor_in_a_host_message_lands_on_the_receivers_current_gpu():
    """``wire.dumps`` carries a CUDA tensor as a host copy: ``pickle.loads`` puts it on the loading rank's
    current GPU, where torch's own pickle would put it on the sender's GPU index (another rank's GPU)."""
    import pickle

    from sbp_core.boxing.wire import dumps

    sender = torch.device("cuda", torch.cuda.device_count() - 1)  # a GPU other than the receiver's, given two
    weight = torch.randn(3, 4, device=sender, requires_grad=True)
    message = {"weight": weight, "ids": torch.arange(5, device=sender).to(torch.uint16), "step": 3,
               "param": torch.nn.Parameter(torch.ones(2, device=sender))}
    data = dumps(message)
    assert b"cuda:" not in data and b"cuda:" in pickle.dumps(weight)  # no device index, where torch's has one
    with torch.cuda.device(0):
        got = pickle.loads(data)
    assert got["weight"].device == torch.device("cuda", 0) and got["ids"].device == torch.device("cuda", 0)
    assert got["weight"].requires_grad and got["step"] == 3
    assert type(got["param"]) is torch.nn.Parameter and got["param"].device == torch.device("cuda", 0)
    torch.testing.assert_close(got["weight"].detach().cpu(), weight.detach().cpu(), rtol=0, atol=0)
    assert got["ids"].dtype == torch.uint16 and got["ids"].cpu().tolist() == [0, 1, 2, 3, 4]

def test_off_cuda_a_value_has_no_ready_mark():
    assert ready_mark(torch.device("cpu")) is None


@pytest.mark.cuda
def test_a_send_waits_for_its_producers_mark_not_for_compute_queued_after_it():
    """The producer's thread marks its value, then queues a long kernel: a transfer given the mark leaves
    while that kernel runs; one without waits for everything the current stream queued."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1024, device=device)
    torch.cuda.synchronize(device)
    cycles = 2_000_000_000  # about a second on any current GPU
    current = torch.cuda.current_stream(device)

    y = x * 2  # the producer's value
    mark = ready_mark(device)
    torch.cuda._sleep(cycles)  # compute its thread queued after it
    with _settled(device, ready=mark):
        sent = y + 1  # stands for the transfer: it reads the producer's value
    assert not current.query()  # returned while the later kernel still runs
    torch.testing.assert_close(sent, x * 2 + 1)
    torch.cuda.synchronize(device)

    y = x * 3
    torch.cuda._sleep(cycles)
    with _settled(device):
        sent = y + 1
    assert current.query()  # without a mark the transfer waited for the sleep as well
    torch.testing.assert_close(sent, x * 3 + 1)


def test_off_cuda_work_behind_marks_runs_as_it_is():
    with after_marks(torch.device("cpu"), [None]):
        x = torch.ones(3) * 2
    assert x.sum() == 6


@pytest.mark.cuda
def test_a_cut_on_another_thread_runs_behind_its_producers_mark_not_behind_later_compute():
    """The compute thread marks its value, then queues a long kernel; a copy thread's cut of the value, run
    behind that mark (``after_marks``), and the mark taken after it are done while the long kernel runs.
    On the shared default stream the cut's mark would wait for that kernel too."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1024, device=device)
    torch.cuda.synchronize(device)
    y = x * 2  # the producer's value, on the compute thread's (default) stream
    produced = ready_mark(device)
    torch.cuda._sleep(2_000_000_000)  # compute queued after it: about a second on any current GPU
    got = {}

    def cut():
        with after_marks(device, [produced]):
            out = y[::2].to(torch.bfloat16).contiguous()  # a cut that copies
            y.record_stream(torch.cuda.current_stream(device))
            got["mark"] = ready_mark(device)
        got["mark"].synchronize()
        got["busy"] = not torch.cuda.current_stream(device).query()  # the default stream, still sleeping
        got["out"] = out

    t = threading.Thread(target=cut)
    t.start()
    t.join()
    assert got["busy"], "the cut's mark waited for the compute queued after its value"
    torch.testing.assert_close(got["out"].float(), (x * 2)[::2].to(torch.bfloat16).float())
    torch.cuda.synchronize(device)


def _receive_posted_after_the_token():
    """A channel given a gloo control twin, as NCCL's are: rank 0 sends 0.5 s late; rank 1 returns
    ``(the groups its receives were posted on in order, seconds before the data's receive was posted,
    what it received)``."""
    import time
    from unittest import mock

    import torch.distributed as dist

    from sbp_core import process_groups
    from sbp_core.boxing import collectives

    group = process_groups.channel_group("token-first", (0, 1))
    twin = dist.new_group([0, 1], backend="gloo")
    process_groups._twins[id(group)] = (group, twin)
    try:
        if dist.get_rank() == 0:
            time.sleep(0.5)
            collectives.send_tensor(torch.arange(4.0), 1, group)
            return None
        posted, start, real = [], time.monotonic(), dist.irecv

        def irecv(tensor, src=None, group=None, **kwargs):
            posted.append(("twin" if group is twin else "data", time.monotonic() - start))
            return real(tensor, src=src, group=group, **kwargs)

        with mock.patch.object(dist, "irecv", irecv):
            got = collectives.recv_tensor((4,), torch.float32, 0, group)
        return [g for g, _ in posted], posted[-1][1], got
    finally:
        del process_groups._twins[id(group)]


def test_a_receive_under_a_control_twin_is_posted_once_the_senders_token_came():
    """Under NCCL no receive waits on the device ahead of its data (``collectives.recv_tensor``): the
    receiver waits for the sender's token on the host, and only then posts the data's receive."""
    from toolkit.rank_pool import get_pool

    _, (order, posted_after, got) = get_pool(2).run(_receive_posted_after_the_token)
    assert order == ["twin", "data"] and posted_after >= 0.4, (order, posted_after)
    assert torch.equal(got, torch.arange(4.0))
