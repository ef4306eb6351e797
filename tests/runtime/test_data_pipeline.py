"""The data pipeline as actors: order, back pressure, errors."""
from __future__ import annotations

import time

import pytest
import torch

from benchkit.token_file import TokenFile, write_tokens
from runtime.data_pipeline import data_stages, to_device
from runtime.executor import RuntimeFailure, run
from runtime.plan import ActorSpec, Plan
from runtime.data_pipeline import _tensors_mapped


@pytest.fixture
def token_file(tmp_path):
    tokens = torch.randint(0, 50000, (40, 16))
    path = str(tmp_path / "tokens.bin")
    write_tokens(path, tokens)
    return TokenFile(path, seq_len=16, batch_size=4), tokens


def _plan(stages, step):
    return Plan(stages + [ActorSpec("step", step, inputs=(stages[-1].name,), queue="compute")])


@pytest.mark.parametrize("quota", [1, 2])
def test_the_step_sees_the_plain_loops_batches_in_order(token_file, quota):
    data, tokens = token_file
    pieces = 25  # more than the file's 10 batches: the pipeline wraps around like the plain loop

    def step(k, batch):
        time.sleep(0.001)  # slower than the reader, so back pressure engages
        return batch["input_ids"].clone()

    res = run(_plan(data.stages(quota=quota), step), pieces, timeout=20)
    plain = [data.collate(k, data.decode(k, data.read(k)))["input_ids"] for k in range(pieces)]
    seen = res.outputs["step"]
    assert len(seen) == pieces and all(torch.equal(a, b) for a, b in zip(seen, plain))
    assert torch.equal(seen[1], tokens[4:8])
    assert all(s.dtype == torch.int64 and s.shape == (4, 16) for s in seen)
    assert {n for n in res.stats} == {"data.read", "data.decode", "data.collate", "step"}  # nothing to copy
    for name in ("data.read", "data.decode", "data.collate"):
        assert res.stats[name].actions == pieces
        assert res.stats[name].max_live <= quota
    assert res.stats["data.read"].max_live == quota


def test_collate_takes_the_decoded_batch_without_a_copy(token_file):
    data, tokens = token_file
    samples = data.decode(3, data.read(3))
    batch = data.collate(3, samples)["input_ids"]
    assert batch.data_ptr() == samples.data_ptr() and torch.equal(batch, tokens[12:16])


@pytest.mark.parametrize("device, copy", [(None, []), ("cpu", []), ("cuda", [("train.to_device", "copy", 3)])])
def test_stage_names_queues_and_quotas(device, copy):
    """A copy actor only where there is a copy to make."""
    stages = data_stages(lambda k: k, lambda k, r: r, lambda k, s: s, device=device, quota=3, prefix="train")
    assert [(s.name, s.queue, s.quota) for s in stages] == [
        ("train.read", "data", 3), ("train.decode", "data", 3), ("train.collate", "data", 3), *copy,
    ]


def test_a_read_error_names_the_read_actor(token_file):
    data, _ = token_file

    def read(k):
        if k == 2:
            raise OSError("disk gone")
        return data.read(k)

    stages = data_stages(read, data.decode, data.collate)
    with pytest.raises(RuntimeFailure, match=r"actor 'data.read' failed on piece 2: OSError: disk gone"):
        run(_plan(stages, lambda k, b: None), 5, timeout=10)


def test_to_device_on_cpu_is_the_batch_itself():
    batch = {"input_ids": torch.zeros(2, 3), "extra": (torch.ones(1), [torch.ones(2)])}
    assert to_device(batch, None) is batch
    assert to_device(batch, "cpu") is batch


@pytest.mark.cuda
def test_to_device_on_cuda_moves_every_tensor_on_the_copy_stream():
    from runtime.data_pipeline import copy_stream

    batch = {"input_ids": torch.arange(6).view(2, 3), "extra": (torch.ones(1), [torch.ones(2)])}
    compute = torch.cuda.current_stream()
    # First pinned and device allocations (and the copy stream) outside the timed call: allocating can
    # synchronise the device.
    to_device(batch, "cuda")
    torch.cuda.synchronize()
    # Keep the compute stream busy: the copy must not queue behind it, and must be done on return.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64
    out = to_device(batch, "cuda")
    assert torch.cuda.current_stream() == compute != copy_stream(out["input_ids"].device)
    assert out["input_ids"].is_cuda and out["extra"][0].is_cuda and out["extra"][1][0].is_cuda
    assert not compute.query()  # the matmuls still run: the copy did not wait for them
    assert torch.equal(out["input_ids"].cpu(), batch["input_ids"])


def test_a_short_file_is_refused(tmp_path):
    path = str(tmp_path / "t.bin")
    write_tokens(path, torch.zeros(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="fewer than one batch of 4"):
        TokenFile(path, seq_len=8, batch_size=4)


def test_a_batchs_containers_keep_their_types_on_the_way_to_the_device():
    t = torch.ones(2)
    out = _tensors_mapped({"a": (t, [t])}, lambda x: x * 2)
    assert type(out["a"]) is tuple and type(out["a"][1]) is list and torch.equal(out["a"][0], t * 2)
