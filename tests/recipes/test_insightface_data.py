"""InsightFace's data: RecordIO, face records, image folders, synthetic identities, pairs, verification, checks.

No processes: files in a temporary directory, one tiny synthetic dataset per
module. Bad input names the file and the record (or field) and what is valid.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from recipes.insightface.data import synthetic
from recipes.insightface.data.face_records import FaceRecords
from recipes.insightface.data.image_folder import ImageFolder
from recipes.insightface.data.images import decode_image, encode_image, normalize
from recipes.insightface.data.pairs import read_pairs, write_pairs
from recipes.insightface.data.recordio import MAGIC, RecordIOError, RecordReader, RecordWriter, pack_image
from recipes.insightface.data.verification import verification_metrics
from recipes.insightface.recipe import RECIPE
from toolkit.config import ConfigError, compose, validate
from toolkit.data import MicroBatches
from toolkit.data.sampler import GlobalBatchSampler

SPEC = synthetic.SyntheticSpec(identities=5, images_per_identity=3, image_size=16, val_identities=3, val_pairs=6)
WORD = MAGIC.to_bytes(4, "little")


@pytest.fixture(scope="module")
def faces(tmp_path_factory):
    return synthetic.ensure(SPEC, str(tmp_path_factory.mktemp("cache")))


def _write(tmp_path, payloads: dict):
    rec, idx = str(tmp_path / "train.rec"), str(tmp_path / "train.idx")
    with RecordWriter(rec, idx) as w:
        for k, v in payloads.items():
            w.write(k, v)
    return rec, idx


def test_recordio_round_trip_including_the_magic_word(tmp_path):
    payloads = {0: b"", 1: b"abc", 2: WORD * 3 + b"xy", 3: b"12345678" + WORD + b"z", 4: os.urandom(999)}
    reader = RecordReader(*_write(tmp_path, payloads))
    assert all(reader.read(k) == v for k, v in payloads.items())
    with open(tmp_path / "train.rec", "rb") as f:
        assert f.read().count(WORD) == 9  # record 2 in 4 parts, record 3 in 2: only part headers hold the word


def test_records_read_from_several_threads_at_once_are_each_their_own(tmp_path):
    """A read-ahead's threads read one reader at once: each thread seeks its own handle."""
    from concurrent.futures import ThreadPoolExecutor

    payloads = {k: os.urandom(1 + 37 * k) for k in range(64)}
    reader = RecordReader(*_write(tmp_path, payloads))
    keys = [k for _ in range(20) for k in payloads]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(reader.read, keys))
    assert got == [payloads[k] for k in keys]


def test_corrupt_and_truncated_records_name_the_file_and_record(tmp_path):
    rec, idx = _write(tmp_path, {0: b"a" * 40, 1: b"b" * 40, 2: b"c" * 40})
    data = bytearray(open(rec, "rb").read())
    data[48:52] = b"\0\0\0\0"  # record 1's magic
    open(rec, "wb").write(bytes(data[:-20]))  # and cut record 2 short
    reader = RecordReader(rec, idx)
    assert reader.read(0) == b"a" * 40
    with pytest.raises(RecordIOError, match=r"train.rec: record 1 \(byte 48\): corrupt, expected the magic"):
        reader.read(1)
    with pytest.raises(RecordIOError, match=r"train.rec: record 2 \(byte 96\): truncated"):
        reader.read(2)


def test_synthetic_faces_read_as_an_insightface_dataset(faces):
    ds = FaceRecords(faces)
    assert (ds.num_classes, ds.image_size, ds.n_images, len(ds)) == (5, 16, 15, 30)
    batch = ds.collate(ds.decode(ds.read(torch.tensor([0, 2, 3, 15, 29]))))
    assert batch["image"].shape == (5, 3, 16, 16) and batch["label"].tolist() == [0, 0, 1, 0, 4]
    assert -1.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    assert torch.equal(batch["image"][3], batch["image"][0].flip(-1))  # row n + i is image i mirrored
    raw = ds.read(torch.tensor([4, 15 + 4]))  # (index, mirrored, record, label, where) each
    image = [decode_image(ds._label(index, record, where)[1], 16) for index, _, record, _, where in raw]
    want = normalize(torch.stack([image[0], image[1].flip(-1)]))
    got = ds.collate(ds.decode(raw))["image"]
    assert got.is_contiguous() and torch.equal(got, want)  # a batch is its images, each decoded alone
    assert ds.collate([])["image"].shape == (0, 3, 16, 16)
    images, issame = read_pairs(os.path.join(faces, "val.bin"), 16)
    assert images.shape == (12, 3, 16, 16) and issame.tolist() == [True, False] * 3
    # The sampler shards a step's rows over the data shards (S(0) over every rank).
    mb = MicroBatches(ds, GlobalBatchSampler(len(ds), 8, seed=0), accum=2, n_shards=2, shard=1)
    assert mb.collate(0, mb.decode(0, mb.read(0)))["image"].shape == (2, 3, 16, 16)


def test_label_out_of_range_names_the_record(tmp_path):
    image = encode_image(torch.zeros(3, 8, 8, dtype=torch.uint8))
    _write(tmp_path, {1: pack_image(1, image), 2: pack_image(7, image)})
    (tmp_path / "property").write_text("3,8,8\n")
    ds = FaceRecords(str(tmp_path))
    assert ds.decode(ds.read(torch.tensor([0])))[0][1] == 1
    with pytest.raises(ValueError, match=r"train.rec: record 2 has label 7, outside 0..2 \(3 classes\)"):
        ds.decode(ds.read(torch.tensor([1])))


def test_image_folder(tmp_path):
    for name, n in (("bob", 2), ("alice", 1)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i}.png").write_bytes(encode_image(torch.full((3, 4, 4), 50 * i, dtype=torch.uint8),
                                                                     "PNG"))
    (tmp_path / "bob" / "notes.txt").write_text("not an image")
    ds = ImageFolder(str(tmp_path), image_size=8)
    assert ds.classes == ["alice", "bob"] and len(ds) == 6
    assert ds.collate(ds.decode(ds.read(torch.tensor([0, 2, 5]))))["label"].tolist() == [0, 1, 1]


def test_pairs_bin_round_trip_and_no_code_in_it(tmp_path):
    images = [torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8) for _ in range(4)]
    write_pairs(str(tmp_path / "p.bin"), images, [True, False])
    got, same = read_pairs(str(tmp_path / "p.bin"), 8)
    assert got.shape == (4, 3, 8, 8) and same.tolist() == [True, False]

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "evil.bin").write_bytes(pickle.dumps(([Evil()], [True])))
    with pytest.raises(ValueError, match="may hold only images and booleans, not posix.system"):
        read_pairs(str(tmp_path / "evil.bin"), 8)


def test_verification_metrics():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, 8, generator=g)
    same = torch.arange(400) % 2 == 0
    b = torch.where(same[:, None], a + 0.1 * torch.randn(400, 8, generator=g), torch.randn(400, 8, generator=g))
    m = verification_metrics(a, b, same)
    assert m["verify_acc"] == 1.0 and m["tar_at_far_1e-3"] == 1.0
    flipped = verification_metrics(a, b, ~same)  # the labels contradict the scores
    assert flipped["verify_acc"] <= 0.5 and flipped["tar_at_far_1e-3"] == 0.0  # best it can do: reject all


def _problems(*overrides, world_size=None):
    cfg = compose(["recipe=insightface", "logger=none", *overrides], run_dir="/tmp/run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, RECIPE, world_size=world_size)
    return "\n".join(info.value.problems)


def test_bad_configs_fail_before_spawn(faces):
    assert "model.num_classes=3: fewer classes than the 4 ranks" in _problems(
        "parallel=dp2_tp2", "model.num_classes=3", "trainer.micro_batch_size=4", "trainer.global_batch_size=16")
    assert f"data.path={faces!r} holds 5 classes but model.num_classes=200; valid: model.num_classes=5" in _problems(
        "data=rec", f"data.path={faces}")
    assert "data.decoder=dali: " in _problems("data.decoder=dali")
    assert "trainer.compile=true with trainer.activation_checkpointing=true: torch.compile cannot" in _problems(
        "trainer.compile=true", "trainer.activation_checkpointing=true")
    assert "model.head.loss='softmax': unknown; valid: arcface, cosface, combined" in _problems(
        "model.head.loss=softmax")
    assert "Partial FC (model.head.sample_rate=0.1) updates only the sampled rows with SGD" in _problems(
        "model.head.sample_rate=0.1", "trainer.optimizer=adamw")
    assert "data.image_size=64: the network takes model.image_size=32 images; valid: data.image_size=32" in \
        _problems("data.image_size=64")
    assert "data.synthetic: blobs must be >= 1, got 0" in _problems("data.synthetic.blobs=0")
    assert "data.synthetic: same- and different-identity pairs need images_per_identity >= 2" in _problems(
        "data.synthetic.images_per_identity=1")
    assert "trainer.global_batch_size=8192: more than the 6400 synthetic images" in _problems(
        "trainer.global_batch_size=8192")
    cfg = compose(["recipe=insightface", "data=rec", f"data.path={faces}", "model.num_classes=5"], run_dir="/tmp/r")
    assert validate(cfg, RECIPE).data_shards == 1
