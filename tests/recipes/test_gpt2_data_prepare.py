"""prepare: deterministic cached token files, a by-document split, one build under concurrency."""
from __future__ import annotations

import json
import os

import pytest
import torch

from recipes.gpt2.data.prepare import Prepared, prepare, validation_documents
from recipes.gpt2.data.tokens import TokenSequences

CAP, VOCAB, SEQ = 300_000, 512, 64


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def stdlib_prepared(tmp_path_factory):
    return prepare("stdlib", VOCAB, SEQ, 0.1, str(tmp_path_factory.mktemp("prep")), max_bytes=CAP)


def test_same_arguments_give_the_same_bytes(stdlib_prepared, tmp_path):
    other = prepare("stdlib", VOCAB, SEQ, 0.1, str(tmp_path), max_bytes=CAP)
    assert other.built and other.directory != stdlib_prepared.directory
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert _bytes(os.path.join(other.directory, name)) == _bytes(os.path.join(stdlib_prepared.directory, name))
    assert other.meta()["splits"] == stdlib_prepared.meta()["splits"]


def test_second_call_is_a_cache_hit(stdlib_prepared):
    cache = os.path.dirname(stdlib_prepared.directory)
    mtime = os.stat(stdlib_prepared.train_path).st_mtime_ns
    again = prepare("stdlib", VOCAB, SEQ, 0.1, cache, max_bytes=CAP)
    assert not again.built and again.directory == stdlib_prepared.directory
    assert os.stat(stdlib_prepared.train_path).st_mtime_ns == mtime
    assert prepare("stdlib", VOCAB, SEQ, 0.2, cache, max_bytes=CAP).directory != stdlib_prepared.directory
    assert not [d for d in os.listdir(cache) if ".tmp-" in d]


def test_token_files_dtype_shape_and_metadata(stdlib_prepared):
    p = stdlib_prepared
    meta = p.meta()
    assert p.dtype == torch.uint16 and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == VOCAB and meta["seq_len"] == SEQ and meta["eos_id"] == p.eos_id == 0
    assert os.path.getsize(p.train_path) == 2 * p.n_train_tokens
    assert os.path.getsize(p.val_path) == 2 * p.n_val_tokens
    assert p.n_train_documents > p.n_val_documents >= 1
    p.verify()
    train = p.tokens("train")
    assert len(train) == p.n_train_sequences == p.n_train_tokens // SEQ
    rows = train.gather(torch.tensor([0, len(train) - 1]))
    assert rows.dtype == torch.int64 and rows.shape == (2, SEQ) and int(rows.max()) < VOCAB
    flat = torch.from_file(p.train_path, size=p.n_train_tokens, dtype=torch.uint16).to(torch.int64)
    assert torch.equal(train[3], flat[3 * SEQ:4 * SEQ])
    assert Prepared.load(p.directory) == Prepared(**{**p.__dict__, "built": False})


def test_verify_detects_a_changed_file(tmp_path):
    p = prepare("stdlib", VOCAB, SEQ, 0.1, str(tmp_path), max_bytes=60_000)
    with open(p.val_path, "r+b") as f:
        f.write(b"\x01\x00")
    with pytest.raises(ValueError, match="val.bin"):
        p.verify()


def _documents_corpus(tmp_path, n=40):
    docs = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(20 + i)) for i in range(n)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path), docs


def _split_documents(p, split):
    n = p.n_train_tokens if split == "train" else p.n_val_tokens
    flat = torch.from_file(p.path(split), size=n, dtype=p.dtype).to(torch.int64).tolist()
    tok, docs, start = p.tokenizer(), [], 0
    for k, i in enumerate(flat):
        if i == p.eos_id:
            docs.append(tok.decode(flat[start:k]))
            start = k + 1
    assert start == len(flat), "every document ends with the separator"
    return docs


def test_split_is_by_document_disjoint_and_complete(tmp_path):
    path, docs = _documents_corpus(tmp_path)
    p = prepare(path, 300, 8, 0.25, str(tmp_path / "cache"), seed=3)
    train, val = _split_documents(p, "train"), _split_documents(p, "val")
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)]  # corpus order kept within a split
    is_val = validation_documents(0.25, 3)
    assert val == [d for i, d in enumerate(docs) if is_val(i)] and len(val) == 10
    assert (p.n_train_documents, p.n_val_documents) == (30, 10)
    splits = {tuple(d for d in range(40) if validation_documents(0.25, seed)(d)) for seed in range(10)}
    assert len(splits) > 1  # the seed moves the split


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.37, 0.5, 0.99])
def test_validation_share_is_exact_up_to_one_document(fraction):
    is_val = validation_documents(fraction, seed=0)
    n = sum(is_val(d) for d in range(1000))
    assert abs(n - 1000 * fraction) <= 1


def test_large_vocab_uses_int32_and_a_given_tokenizer(stdlib_prepared, tmp_path):
    path, _ = _documents_corpus(tmp_path, n=10)
    p = prepare(path, 70_000, 8, 0.0, str(tmp_path / "cache"), tokenizer=stdlib_prepared.tokenizer_path)
    assert p.dtype == torch.int32 and p.vocab_size == 70_000 and p.meta()["tokenizer_vocab_size"] == VOCAB
    assert os.path.getsize(p.train_path) == 4 * p.n_train_tokens and p.n_val_tokens == 0
    assert isinstance(p.tokens(), TokenSequences)
    with pytest.raises(ValueError, match=f"has {VOCAB} ids, more than vocab_size=300"):
        prepare(path, 300, 8, 0.0, str(tmp_path / "cache"), tokenizer=stdlib_prepared.tokenizer_path)


def test_too_small_a_split_is_refused(tmp_path):
    path, _ = _documents_corpus(tmp_path, n=10)
    with pytest.raises(ValueError, match=r"the train split has \d+ tokens \(\d+ of 10 documents\), fewer than "
                                         r"one sequence of seq_len=4096"):
        prepare(path, 300, 4096, 0.5, str(tmp_path / "cache"))
    assert not any(validation_documents(0.01, 0)(d) for d in range(10))
    with pytest.raises(ValueError, match=r"the val split has 0 tokens \(0 of 10 documents\)"):
        prepare(path, 300, 8, 0.01, str(tmp_path / "cache"), seed=0)
    assert not [d for d in os.listdir(tmp_path / "cache") if d.startswith("prepared-") and not d.endswith(".lock")]


@pytest.mark.parametrize("name,value,message", [
    ("seq_len", 0, "seq_len must be a positive int, got 0"),
    ("val_fraction", 1.0, r"val_fraction must be a number in \[0, 1\), got 1.0"),
    ("vocab_size", 1, "vocab_size must be an int >= 2, got 1"),
])
def test_bad_arguments_name_the_value(tmp_path, name, value, message):
    args = {"source": "stdlib", "vocab_size": VOCAB, "seq_len": SEQ, "val_fraction": 0.1,
            "cache_dir": str(tmp_path), "max_bytes": 1000, name: value}
    with pytest.raises(ValueError, match=message):
        prepare(**args)


def _prepare_in_child(barrier, cache, queue):
    barrier.wait()
    p = prepare("stdlib", VOCAB, SEQ, 0.1, cache, max_bytes=100_000)
    queue.put((p.directory, p.built, p.meta()["splits"]["train"]["sha256"]))


def test_two_processes_build_once(tmp_path):
    from toolkit.child import host_rank_context

    ctx = host_rank_context()  # forked from the ranks' fork server, as training ranks are
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(barrier, str(tmp_path), queue)) for _ in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert sorted(built for _, built, _ in results) == [False, True]
    assert len({(d, sha) for d, _, sha in results}) == 1
    entries = sorted(d for d in os.listdir(tmp_path) if not d.endswith(".lock"))
    assert [d.split("-")[0] for d in entries] == ["prepared", "tokenizer"]
