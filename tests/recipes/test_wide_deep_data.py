"""Wide&Deep's data: hashing, the planted generator, exact AUC, Criteo TSV and parquet readers, bad input."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from recipes.wide_deep.criteo_parquet import CriteoParquet
from recipes.wide_deep.criteo_tsv import CriteoTSV
from recipes.wide_deep.features import Encoder
from recipes.wide_deep.hashing import FeatureHasher
from recipes.wide_deep.metrics import auc, logloss
from recipes.wide_deep.planted_cache import Encoded, ensure
from recipes.wide_deep.synthetic import PlantedCriteo


def test_hashing_never_leaves_the_table():
    raw = [[2 ** 64 - 1, -5, "68fd1e64", None, "", "not hex", 10 ** 12, b"0a"]] * 2
    shared = FeatureHasher(8, vocab_size=7)
    ids = shared(raw)
    assert ids.dtype == torch.int64 and ids.shape == (2, 8) and 0 <= ids.min() and ids.max() < 7
    assert torch.equal(ids[0], ids[1]) and torch.equal(shared(raw), ids)  # deterministic
    assert ids[0, 3] == shared([[0, 0, 0, "", 0, 0, 0, 0]])[0, 3]  # None and "" are both missing
    per_field = FeatureHasher(8, field_vocab_sizes=[1, 2, 3, 4, 5, 6, 7, 8])
    ids = per_field(raw)
    offsets = np.cumsum([0, 1, 2, 3, 4, 5, 6, 7])
    assert per_field.rows == 36 and all(o <= i < o + n for i, o, n in zip(ids[0].tolist(), offsets, range(1, 9)))
    big = torch.randint(0, 2 ** 62, (1000, 8)).numpy()
    assert FeatureHasher(8, vocab_size=100)(big).max() < 100
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        FeatureHasher(8)
    with pytest.raises(ValueError, match="lists 2 sizes for 8"):
        FeatureHasher(8, field_vocab_sizes=[3, 4])



def test_hex_tokens_of_up_to_16_digits_key_as_their_number():
    """A hex string of 1 to 16 digits keys as ``int(s, 16)``: a 16-digit token lands on the row of that 64-bit
    integer, as an 8-digit one does; 17 digits are hashed as a string."""
    from recipes.wide_deep.hashing import value_key

    assert value_key("68fd1e64") == 0x68FD1E64
    assert value_key("0123456789abcdef") == 0x0123456789ABCDEF and value_key("FFFFFFFFFFFFFFFF") == 2 ** 64 - 1
    import hashlib

    s17 = "1" + "0" * 16  # 17 digits: hashed as any other string
    assert value_key(s17) == int.from_bytes(hashlib.blake2b(s17.encode(), digest_size=8).digest(), "little")
    hasher = FeatureHasher(3, vocab_size=1000)
    tokens = [["0123456789abcdef", "fedcba9876543210", "ffffffffffffffff"]]
    numbers = np.array([[0x0123456789ABCDEF, 0xFEDCBA9876543210, 2 ** 64 - 1]], dtype=np.uint64)
    assert torch.equal(hasher(tokens), hasher(numbers))

def test_auc_is_exact_with_ties_and_logloss():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=gen).double()  # many ties
    labels = torch.randint(0, 2, (60,), generator=gen).double()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos.tolist(), neg.tolist())]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert logloss(torch.zeros(4), torch.tensor([0.0, 1, 0, 1])) == pytest.approx(np.log(2))
    with pytest.raises(ValueError, match="both classes"):
        auc(torch.ones(3), torch.ones(3))


def test_planted_rows_are_a_function_of_the_row():
    data = PlantedCriteo(10 ** 9, seed=3)
    rows = torch.tensor([5, 123456789, 7, 5])
    a, b = data.generate(rows), data.generate(torch.tensor([7]))
    assert torch.equal(a["cats"][2], b["cats"][0]) and torch.equal(a["dense"][0], a["dense"][3])
    assert a["cats"].shape == (4, 26) and a["dense"].shape == (4, 13)
    assert (a["cats"] < data.cardinality.long()).all() and (a["cats"] >= 0).all()
    many = data.generate(torch.arange(20000))
    ctr, bayes = float(many["label"].mean()), auc(many["prob"], many["label"])
    assert 0.15 < ctr < 0.45 and 0.7 < bayes < 0.9, (ctr, bayes)


def test_planted_rows_stay_the_rows_they_were():
    """A checkpoint resumed, or an AUC compared, on another version of this code reads the same rows:
    rows 0, 5 and 123456789 of seed 3 as the generator first drew them (their counts and categories are
    floors of libm values, so a last-bit difference between CPUs could move one; none of these is near a
    boundary)."""
    got = PlantedCriteo(10 ** 9, seed=3).generate(torch.tensor([0, 5, 123456789]))
    assert got["cats"].tolist() == [
        [0, 1, 0, 1, 0, 6, 2, 9, 4, 6, 0, 8, 6, 6, 2, 6, 63, 73, 27, 18, 5, 330, 5, 431, 3, 1],
        [0, 1, 0, 3, 1, 0, 4, 1, 5, 0, 15, 11, 3, 25, 9, 7, 0, 1, 83, 137, 86, 37, 0, 22, 259, 39],
        [1, 2, 1, 1, 4, 3, 7, 5, 0, 1, 8, 16, 1, 0, 19, 2, 24, 26, 6, 21, 1, 160, 0, 169, 72, 799]]
    assert got["dense"].tolist() == [[1, 8, 0, 0, 5, 0, 2, 5, 2, 0, 0, 8, 1], [1, 0, 0, 0, 0, 1, 0, 0, 1, 5, 0, 3, 0],
                                     [0, 2, 0, 0, 0, 3, 6, 12, 0, 0, 1, 0, 0]]
    assert got["label"].tolist() == [0, 0, 1]
    assert got["prob"].tolist() == pytest.approx([0.4645589499597331, 0.14880405272757058, 0.5064606291853756],
                                                 rel=1e-12)


def test_the_planted_cache_holds_the_encoded_rows_once_per_generator_and_encoder(tmp_path):
    from recipes.wide_deep.data import Synthetic

    planted = PlantedCriteo(70_000, seed=5, max_cardinality=300)  # more rows than one chunk of the writer
    enc = Encoder(FeatureHasher(26, vocab_size=1000))
    root = ensure(planted, enc, str(tmp_path))
    stamps = {f: os.stat(os.path.join(root, f)).st_mtime_ns for f in os.listdir(root)}
    assert ensure(PlantedCriteo(70_000, seed=5, max_cardinality=300), Encoder(FeatureHasher(26, vocab_size=1000)),
                  str(tmp_path)) == root
    assert {f: os.stat(os.path.join(root, f)).st_mtime_ns for f in os.listdir(root)} == stamps  # not written again
    assert ensure(PlantedCriteo(70_000, seed=6, max_cardinality=300), enc, str(tmp_path)) != root
    assert ensure(planted, Encoder(FeatureHasher(26, vocab_size=999)), str(tmp_path)) != root
    source = Synthetic(Encoded(root))
    rows = torch.tensor([0, 65_535, 65_536, 69_999, 123, 123])
    got = source.decode(source.read(rows))
    raw = planted.generate(rows)
    want = enc.collate(list(zip(raw["label"].tolist(), raw["dense"].tolist(), raw["cats"].tolist())))
    assert len(source) == 70_000 and got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    os.remove(os.path.join(root, "ids.npy"))
    with pytest.raises(FileNotFoundError, match="lacks.*ids.npy.*remove the directory"):
        ensure(planted, enc, str(tmp_path))


def _line(label="1", counts=None, cats=None) -> str:
    counts = counts if counts is not None else ["1", "", "-2"] + ["3"] * 10
    cats = cats if cats is not None else ["68fd1e64", ""] + ["a" * 8] * 24
    return "\t".join([label] + counts + cats) + "\n"


def test_criteo_tsv_skips_and_counts_malformed_lines(tmp_path):
    lines = [_line(), _line("0"), "1\t2\t3\n", _line("x"), _line(counts=["z"] * 13), _line("0"), _line()]
    path = tmp_path / "train.txt"
    path.write_text("".join(lines))
    data = CriteoTSV([str(path)], str(tmp_path / "cache"))
    assert len(data) == 4 and data.n_malformed == 3
    summary = data.summary()
    assert "skipped 3 malformed of 7 lines" in summary and "columns at lines [3]" in summary
    assert "label at lines [4]" in summary and "count at lines [5]" in summary
    samples = data.decode(data.read([3, 0]))
    assert samples[1] == (1, [1, 0, -2] + [3] * 10, [0x68FD1E64, 2 ** 64 - 1] + [0xAAAAAAAA] * 24)
    assert samples[0][0] == 1 and data.decode(data.read([1]))[0][0] == 0
    batch = Encoder(FeatureHasher(26, vocab_size=1000)).collate(samples)
    assert batch["ids"].shape == (2, 26) and batch["dense"][1, 2] == pytest.approx(-np.log(3))
    assert CriteoTSV([str(path)], str(tmp_path / "cache")).n_malformed == 3  # from the cached index
    with pytest.raises(IndexError, match="outside the 4 well-formed lines"):
        data.read([4])


def test_criteo_tsv_read_from_several_threads_at_once(tmp_path):
    """A read-ahead's threads read one file set at once: each thread seeks its own handles."""
    from concurrent.futures import ThreadPoolExecutor

    lines = [_line(str(i % 2), counts=[str(i)] * 13) for i in range(300)]
    path = tmp_path / "train.txt"
    path.write_text("".join(lines))
    data = CriteoTSV([str(path)], str(tmp_path / "cache"))
    picks = [np.random.default_rng(k).integers(0, 300, 50) for k in range(40)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(data.read, picks))
    assert all(g == [lines[i].encode() for i in rows] for g, rows in zip(got, picks))


def test_criteo_tsv_wrong_column_count_over_the_limit_names_file_and_line(tmp_path):
    path = tmp_path / "day_0"
    path.write_text(_line() + "1,2,3\n" * 3 + _line())
    with pytest.raises(ValueError, match=r"day_0:3: 1 columns, a Criteo line has 40 .* 3 of 5 lines"):
        CriteoTSV([str(path)], str(tmp_path / "cache"), max_wrong_columns=1)
    assert len(CriteoTSV([str(path)], str(tmp_path / "cache"), max_wrong_columns=3)) == 2


def test_criteo_parquet_reads_rows_and_skips_bad_labels(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 9
    cols = {"label": pa.array([1, 0, None, 1, 7, 0, 1, 0, 1], pa.int64())}
    for i in range(1, 14):
        cols[f"I{i}"] = pa.array([None if r == 0 else r * i for r in range(n)], pa.int64())
    for i in range(1, 27):
        cols[f"C{i}"] = (pa.array([2 ** 40 + r for r in range(n)], pa.int64()) if i % 2 else
                         pa.array([None if r == 1 else f"{r:08x}" for r in range(n)]))
    pq.write_table(pa.table(cols), tmp_path / "part.parquet", row_group_size=4)
    data = CriteoParquet([str(tmp_path / "part.parquet")])
    assert len(data) == 7 and data.n_malformed == 2 and "rows [3, 5]" in data.summary()
    samples = data.decode(data.read([6, 0, 2]))  # file rows 8, 0, 3
    assert [s[0] for s in samples] == [1, 1, 1]
    assert samples[0][1][:2] == [8.0, 16.0] and samples[1][1][0] == 0.0  # missing count -> 0
    assert samples[0][2][0] == 2 ** 40 + 8 and samples[0][2][1] == 8  # int as is; "00000008" hex
    assert samples[1][2][1] == 0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"label": pa.array([1])}), bad)
    with pytest.raises(ValueError, match=r"bad.parquet: no column\(s\) \['I1'"):
        CriteoParquet([str(bad)])


def test_splits_of_a_tsv_directory_hold_out_the_tail(tmp_path):
    from types import SimpleNamespace

    from recipes.wide_deep.config import DataSchema, ModelSchema
    from recipes.wide_deep.data import open_splits

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "day_0").write_text("".join(_line(str(i % 2)) for i in range(8)) + "bad\n")
    (tmp_path / "data" / "day_1").write_text("".join(_line("1") for _ in range(2)))
    data = SimpleNamespace(**{**DataSchema().__dict__, "source": "criteo_tsv", "path": str(tmp_path / "data"),
                              "val_fraction": 0.2, "cache_dir": str(tmp_path / "cache")})
    splits = open_splits(data, ModelSchema(vocab_size=50))
    assert (len(splits.train), len(splits.val)) == (8, 2) and splits.bayes is None
    assert "skipped 1 malformed of 9 lines" in splits.summary
    batch = splits.val.load(torch.tensor([0, 1]))
    assert batch["label"].tolist() == [1.0, 1.0] and batch["ids"].max() < 50  # day_1's rows
    assert splits.train.load(torch.tensor([7]))["label"].tolist() == [1.0]


def test_columns_encode_as_the_same_samples_listed_row_by_row():
    from recipes.wide_deep.features import Columns

    raw = PlantedCriteo(5000, seed=3).generate(torch.tensor([4, 4999, 0, 17]))
    listed = list(zip(raw["label"].tolist(), raw["dense"].tolist(), raw["cats"].tolist()))
    columns = Columns(raw["label"].numpy(), raw["dense"].numpy(), raw["cats"].numpy())
    enc = Encoder(FeatureHasher(26, vocab_size=1000))
    a, b = enc.collate(listed), enc.collate(columns)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
