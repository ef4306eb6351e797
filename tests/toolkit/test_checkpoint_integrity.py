"""Checkpoints are atomic and checked: latest, keep-last-k, checksums naming the file, no pickle, a killed save.

Most checks run in this process (``save``/``load`` work as a world of one
without a process group); two run on a pool of two gloo ranks of their own:
a corrupted file that only one rank reads fails the load on every rank, and
a rank killed with SIGKILL in the middle of a save leaves the previous
checkpoint complete, loadable and ``latest``.
"""
import json
import os
import pickle
import random
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import sbp_core as sc
from sbp_core.sbp import Split
from toolkit import checkpoint as ckpt
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.storage import PAUSE_ENV
from toolkit.rank_pool import RankError, RankPool


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "scheduler": {"last_epoch": step, "base_lrs": [1e-3], "_get_lr_called_within_step": False},
            "sampler": {"epoch": 1, "index": 10 * step}, "step": step,
            "extra": {"name": "tiny", "shape": (3, 4), "big": 2 ** 70, "lr": 0.1 + 0.2, "ids": {1: "a", 2: "b"}}}


def test_round_trip_of_plain_state(tmp_path):
    state = _state(3)
    path = ckpt.save(str(tmp_path), 3, state)
    assert path == str(tmp_path / "step_3") and ckpt.latest(str(tmp_path)) == path
    out = ckpt.load(str(tmp_path))  # no template: everything, tensors whole
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and torch.equal(out["model"]["b"], state["model"]["b"])
    assert out["scheduler"] == state["scheduler"] and out["sampler"] == state["sampler"] and out["step"] == 3
    assert out["extra"] == state["extra"] and isinstance(out["extra"]["shape"], tuple)
    template = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": None, "missing": 5}
    filled = ckpt.load(path, template)
    assert filled["model"]["w"] is template["model"]["w"] and torch.equal(template["model"]["w"], state["model"]["w"])
    assert filled["step"] == 3 and filled["missing"] == 5


def test_dtypes_and_odd_shapes_round_trip_bit_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {"bf16": torch.randn(5, 3, generator=g).bfloat16(), "f16": torch.randn(4, generator=g).half(),
              "f64": torch.randn(2, 2, generator=g).double(), "i64": torch.arange(-3, 3),
              "bool": torch.tensor([1, 0, 1]).bool(),
              "u8": torch.arange(7, dtype=torch.uint8), "scalar": torch.tensor(3.25), "empty": torch.zeros(0, 4),
              "strided": torch.randn(6, 8, generator=g)[::2, 1::3], "nan": torch.tensor([float("nan"), float("inf")])}
    ckpt.save(str(tmp_path), 1, {"t": values})
    out = ckpt.load(str(tmp_path))["t"]
    for k, v in values.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k].view(-1).view(torch.uint8) if v.numel() else out[k],
                           v.contiguous().view(-1).view(torch.uint8) if v.numel() else v), k


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(7)
    random.seed(7)
    ckpt.save(str(tmp_path), 1, {"rng": ckpt.rng_state()})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    ckpt.set_rng_state(ckpt.load(str(tmp_path), {"rng": None})["rng"])
    again = (torch.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]


@pytest.mark.cuda
def test_cuda_rng_state_round_trip(tmp_path):
    torch.cuda.init()  # a job's CUDA is running when it saves; before that, manual_seed only queues the seed
    torch.cuda.manual_seed(7)
    ckpt.save(str(tmp_path), 1, {"rng": ckpt.rng_state()})
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(99)
    ckpt.set_rng_state(ckpt.load(str(tmp_path), {"rng": None})["rng"])
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_keep_last_and_latest(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        ckpt.save(root, step, _state(step), keep_last=2)
    assert sorted(os.listdir(root)) == ["latest", "step_3", "step_4"]
    assert ckpt.latest(root) == os.path.join(root, "step_4")
    assert ckpt.load(root, {"step": None})["step"] == 4
    # A save that never finished: a .tmp directory without a manifest is never "latest" and is removed next time.
    os.makedirs(os.path.join(root, "step_5.tmp"))
    open(os.path.join(root, "step_5.tmp", "__0_0.distcp"), "wb").close()
    assert ckpt.latest(root) == os.path.join(root, "step_4")
    # Nor is a step directory whose manifest is gone (a removal that never finished).
    os.makedirs(os.path.join(root, "step_2"))
    open(os.path.join(root, "step_2", "__0_0.distcp"), "wb").close()
    assert ckpt.latest(root) == os.path.join(root, "step_4")
    ckpt.save(root, 6, _state(6), keep_last=2)
    assert sorted(os.listdir(root)) == ["latest", "step_4", "step_6"]
    # A pointer to a missing directory falls back to the newest complete checkpoint.
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_9\n")
    assert ckpt.latest(root) == os.path.join(root, "step_6")
    assert ckpt.latest(str(tmp_path / "nothing")) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.load(str(tmp_path / "nothing"))


def test_same_step_saved_again_replaces_it(tmp_path):
    ckpt.save(str(tmp_path), 5, _state(5))
    changed = _state(5)
    changed["sampler"]["index"] = -1
    ckpt.save(str(tmp_path), 5, changed)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_5"]
    assert ckpt.load(str(tmp_path), {"sampler": None})["sampler"]["index"] == -1


def _save_killed_at_its_rename(monkeypatch, root: str, step: int, state: dict, **kw) -> None:
    """``ckpt.save`` of ``step``, killed as it renames its finished ``step_<step>.tmp`` into place."""
    from toolkit.checkpoint import directory

    rename = os.rename

    def killed(src, dst):
        if src.endswith(f"step_{step}.tmp"):
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    monkeypatch.setattr(directory.os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, step, state, **kw)
    monkeypatch.setattr(directory.os, "rename", rename)


@pytest.mark.parametrize("keep_last", [None, 1])
def test_a_crash_while_a_step_is_saved_again_leaves_it_complete(tmp_path, monkeypatch, keep_last):
    """Saving a step that exists moves the old directory aside, then renames the new one into place; a
    crash between the two renames leaves no ``step_5``, and the finished ``step_5.tmp`` is the newest
    complete checkpoint (with ``keep_last=1`` the only one): ``latest`` finds it, and the next save puts
    it in place."""
    root = str(tmp_path)
    ckpt.save(root, 4, _state(4), keep_last=keep_last)
    ckpt.save(root, 5, _state(5), keep_last=keep_last)
    again = _state(5)
    again["sampler"]["index"] = -1
    _save_killed_at_its_rename(monkeypatch, root, 5, again, keep_last=keep_last)  # the second: step_5 is aside
    assert not os.path.exists(os.path.join(root, "step_5"))
    assert ckpt.latest(root) == os.path.join(root, "step_5.tmp")
    assert ckpt.load(root, {"sampler": None})["sampler"]["index"] == -1
    ckpt.save(root, 6, _state(6), keep_last=None)
    assert sorted(os.listdir(root)) == ["latest"] + ["step_4"] * (keep_last is None) + ["step_5", "step_6"]
    assert ckpt.load(os.path.join(root, "step_5"), {"sampler": None})["sampler"]["index"] == -1


def test_a_finished_save_the_pointer_never_reached_is_not_resumed_nor_kept(tmp_path, monkeypatch):
    """A save of a new step that crashed after its manifest, before its rename: ``latest`` still names the
    previous step, so a resume continues from there, and the next save removes the abandoned run's
    ``step_<N>.tmp`` rather than putting it in place (a later ``init_from`` of ``step_<N>`` would take it)."""
    root = str(tmp_path)
    ckpt.save(root, 4, _state(4))
    _save_killed_at_its_rename(monkeypatch, root, 8, _state(8))
    assert os.path.isfile(os.path.join(root, "step_8.tmp", "manifest.json"))
    assert ckpt.latest(root) == os.path.join(root, "step_4")
    ckpt.save(root, 6, _state(6))
    assert sorted(os.listdir(root)) == ["latest", "step_4", "step_6"]


def _data_file(path):
    return os.path.join(path, "__0_0.distcp")


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = ckpt.save(str(tmp_path), 1, _state(1))
    victim = _data_file(path)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(CheckpointError, match=re.escape(victim) + ".*truncated"):
        ckpt.load(path)


@pytest.mark.parametrize("name", ["__0_0.distcp", "metadata.json", "state.json"])
def test_flipped_byte_is_refused_naming_the_file(tmp_path, name):
    path = ckpt.save(str(tmp_path), 1, _state(1))
    victim = os.path.join(path, name)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=re.escape(f"{victim}: checksum mismatch")):
        ckpt.load(path)
    with pytest.raises(CheckpointError, match=re.escape(f"{victim}: checksum mismatch")):
        ckpt.verify(path)  # every file in full


def test_damaged_or_missing_manifest(tmp_path):
    path = ckpt.save(str(tmp_path), 1, _state(1))
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        doc = json.load(f)
    doc["body"]["files"]["state.json"]["crc32"] = "00000000"
    with open(mpath, "w") as f:
        json.dump(doc, f)
    with pytest.raises(CheckpointError, match=re.escape(f"{mpath}: checksum mismatch")):
        ckpt.load(path)
    os.remove(mpath)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.load(path)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    path = ckpt.save(str(tmp_path), 1, _state(1))

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    out = ckpt.load(path)
    assert out["step"] == 1
    assert not any(n.endswith(".metadata") for n in os.listdir(path))  # no DCP pickle metadata file


def test_objects_that_are_not_data_are_refused(tmp_path):
    with pytest.raises(TypeError, match="'extra/fn'"):
        ckpt.save(str(tmp_path), 1, {"extra": {"fn": print}})
    assert ckpt.latest(str(tmp_path)) is None


def test_template_tensor_missing_from_checkpoint(tmp_path):
    path = ckpt.save(str(tmp_path), 1, _state(1))
    with pytest.raises(CheckpointError, match="'model/v'"):
        ckpt.load(path, {"model": {"v": torch.zeros(3)}})


# -- on ranks ------------------------------------------------------------------

def save_sharded(root, step, pause=None):
    """Worker: save a tensor split over two ranks plus plain state; ``pause``: (rank, marker) to stall mid-save."""
    os.environ.pop(PAUSE_ENV, None)
    if pause is not None:
        os.environ[PAUSE_ENV] = f"{pause[0]}:{pause[1]}"
    try:
        p = sc.placement("cpu", [0, 1])
        w = sc.distribute(torch.arange(40.0).view(10, 4) * step, p, Split(0))
        return ckpt.save(root, step, {"model": {"w": w}, "step": step, "rng": ckpt.rng_state()}, keep_last=3)
    finally:
        os.environ.pop(PAUSE_ENV, None)


def load_sharded(root):
    """Worker: load into the other split; returns this rank's shard and the step."""
    p = sc.placement("cpu", [0, 1])
    w = sc.zeros(10, 4, placement=p, sbp=Split(1))
    out = ckpt.load(root, {"model": {"w": w}, "step": None})
    return w._local.clone(), out["step"], dist.get_rank()


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=60.0) as p:
        yield p


def test_corruption_seen_by_one_rank_fails_every_rank(pool, tmp_path):
    root = str(tmp_path)
    path = pool.run(save_sharded, root, 1)[0]
    shards = [r[0] for r in pool.run(load_sharded, root)]
    assert torch.equal(torch.cat(shards, 1), torch.arange(40.0).view(10, 4))
    victim = os.path.join(path, "__1_0.distcp")  # rank 1's rows, read by both ranks after resharding
    with open(os.path.join(path, "metadata.json")) as f:
        record = json.load(f)["tensors"]["model/w"]["chunks"][1]
    assert record["file"] == "__1_0.distcp"
    with open(victim, "r+b") as f:
        f.seek(record["offset"] + record["length"] // 2)
        f.write(b"\x00" * 8)
    outcomes = pool.outcomes(load_sharded, root)
    for o in outcomes:
        assert not o.ok and o.exc_type == "CheckpointError" and f"{victim}: checksum mismatch" in o.message


def test_save_killed_mid_write_keeps_previous_latest(pool, tmp_path):
    root = str(tmp_path / "run")
    first = pool.run(save_sharded, root, 1)[0]
    marker = str(tmp_path / "rank1-paused")
    failure = {}

    def doomed_save():
        try:
            pool.run(save_sharded, root, 2, pause=(1, marker), call_timeout=120)
        except RankError as exc:
            failure["error"] = exc

    thread = threading.Thread(target=doomed_save)
    thread.start()
    deadline = time.monotonic() + 90
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker), "rank 1 never reached the middle of its save"
    time.sleep(0.1)
    with open(marker) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    thread.join(timeout=60)
    assert "died" in str(failure.get("error")), failure
    # Rank 1 had written its data file; nothing was published.
    assert os.path.isdir(os.path.join(root, "step_2.tmp"))
    assert "__1_0.distcp" in os.listdir(os.path.join(root, "step_2.tmp"))
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert ckpt.latest(root) == first
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step_1"
    out = ckpt.load(root, {"model": {"w": torch.zeros(10, 4)}, "step": None})  # in this process
    assert out["step"] == 1 and torch.equal(out["model"]["w"], torch.arange(40.0).view(10, 4))
    # The next save (here by this process, a world of one) clears the stale .tmp directory.
    assert ckpt.save(root, 3, {"step": 3}) == os.path.join(root, "step_3")
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]


def test_pruning_never_removes_the_checkpoint_just_saved(tmp_path):
    """A re-saved step can be the oldest by its manifest's time; ``keep`` still survives ``keep_last=1``."""
    from toolkit.checkpoint import directory, manifest

    for step, mtime in (("step_1", 2_000_000_000), ("step_5", 2_000_000_100)):
        os.makedirs(tmp_path / step)
        (tmp_path / step / manifest.NAME).write_text("{}")
        os.utime(tmp_path / step / manifest.NAME, (mtime, mtime))
    assert directory.prune(str(tmp_path), 1, keep="step_1") == []
    assert (tmp_path / "step_1" / manifest.NAME).exists()


def test_keys_that_look_like_path_tokens_round_trip(tmp_path):
    """A string key starting with ``~`` or ``#`` (or holding ``/`` or ``%``) is escaped in the tensor's path, so
    ``"~rank0"`` in the shared state does not land on rank 0's own entries, nor ``"#1"`` on the int key ``1``."""
    g = torch.Generator().manual_seed(0)
    state = {"~rank0": {"rng": torch.randn(3, generator=g)}, "rng": torch.randn(3, generator=g),
             "ids": {"#1": torch.randn(2, generator=g), 1: torch.randn(2, generator=g)},
             "odd": {"a/b%": torch.randn(2, generator=g), "~": torch.randn(1, generator=g)}}
    ckpt.save(str(tmp_path), 1, state, per_rank=("rng",))
    out = ckpt.load(str(tmp_path))
    assert torch.equal(out["~rank0"]["rng"], state["~rank0"]["rng"]) and torch.equal(out["rng"], state["rng"])
    for part in ("ids", "odd"):
        assert out[part].keys() == state[part].keys()
        for k, v in state[part].items():
            assert torch.equal(out[part][k], v), (part, k)
