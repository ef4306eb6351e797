"""Corpora: the standard-library default, local text sources, and the offline hub error."""
from __future__ import annotations

import json
import os
import sysconfig

import pytest

from recipes.gpt2.data.corpus import local_corpus, stdlib_corpus, stdlib_files
from recipes.gpt2.data.source import open_corpus
from recipes.gpt2.data.hub import OfflineError


def test_stdlib_files_are_sorted_python_sources_without_tests_or_site_packages():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    for f in files:
        parts = f.split("/")[:-1]
        assert not {"site-packages", "test", "tests", "idle_test", "__pycache__"} & set(parts), f
    assert "os.py" in files and "json/decoder.py" in files


def test_stdlib_corpus_is_deterministic_and_capped():
    corpus = stdlib_corpus(max_bytes=50_000)
    first, again = list(corpus.documents()), list(corpus.documents())
    assert first == again and all(first)
    total = sum(len(d.encode("utf-8")) for d in first)
    assert 50_000 - 4 < total <= 50_000
    assert corpus.identity == stdlib_corpus(max_bytes=50_000).identity
    assert corpus.identity != stdlib_corpus(max_bytes=60_000).identity
    assert open_corpus(None, max_bytes=50_000).identity == corpus.identity == open_corpus("stdlib", 50_000).identity


def test_stdlib_corpus_skips_undecodable_files_and_test_dirs(tmp_path, monkeypatch):
    (tmp_path / "b.py").write_text("b = 2\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "latin.py").write_bytes("x = 'caf\xe9'\n".encode("latin-1"))
    for skipped in ("test", "site-packages", "pkg/tests"):
        (tmp_path / skipped).mkdir(parents=True)
        (tmp_path / skipped / "t.py").write_text("skipped\n")
    (tmp_path / "pkg" / "m.py").write_text("m = 3\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    paths = dict(sysconfig.get_paths(), stdlib=str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    assert stdlib_files() == ["a.py", "b.py", "latin.py", "pkg/m.py"]
    assert list(stdlib_corpus().documents()) == ["a = 1\n", "b = 2\n", "m = 3\n"]


def test_txt_file_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("first line\nstill first\n\n\nsecond é\n  \nthird")
    assert list(open_corpus(str(path)).documents()) == ["first line\nstill first\n", "second é\n", "third"]


def test_txt_directory_reads_files_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("two")
    (tmp_path / "b.txt").write_text("three")
    (tmp_path / "a.txt").write_text("one")
    corpus = open_corpus(str(tmp_path))
    assert list(corpus.documents()) == ["one", "three", "two"]
    (tmp_path / "c.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"mixes file kinds \['.jsonl', '.txt'\]"):
        open_corpus(str(tmp_path))


def test_jsonl_reads_the_text_field_and_names_a_missing_one(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"doc {i}", "id": i}) for i in range(3)) + "\n\n")
    assert list(open_corpus(str(path), text_field="body").documents()) == ["doc 0", "doc 1", "doc 2"]
    with pytest.raises(ValueError, match=r"c.jsonl:1: no text field 'text'; the record has \['body', 'id'\]"):
        list(open_corpus(str(path)).documents())


def test_parquet_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": ["alpha", "", "gamma δ"], "n": [1, 2, 3]}), path)
    assert list(open_corpus(path).documents()) == ["alpha", "gamma δ"]
    with pytest.raises(ValueError, match=r"no column 'body'; the columns are \['n', 'text'\]"):
        list(local_corpus(path, text_field="body").documents())


def test_identity_follows_file_changes(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one")
    before = open_corpus(str(path)).identity
    path.write_text("one two")
    assert open_corpus(str(path)).identity != before


def test_bad_sources_name_the_value_and_the_choices(tmp_path):
    bad = tmp_path / "c.csv"
    bad.write_text("x")
    with pytest.raises(ValueError, match=r"suffix '.csv', valid suffixes \['.txt', '.jsonl', '.parquet'\]"):
        open_corpus(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        open_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="max_bytes must be None"):
        open_corpus("stdlib", max_bytes=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no .txt, .jsonl, .parquet files"):
        local_corpus(str(tmp_path / "empty"))


def test_hub_name_offline_says_to_pass_a_local_path(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(OfflineError, match=r"'someone/some_corpus'.*offline.*pass a local path"):
        open_corpus("someone/some_corpus")
    assert not os.path.exists("someone/some_corpus")


@pytest.mark.parametrize("error,raised", [(ConnectionError("no route to host"), OfflineError),
                                          (FileNotFoundError("no such dataset"), FileNotFoundError)])
def test_hub_failures_say_to_pass_a_local_path(monkeypatch, error, raised):
    import datasets

    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)

    def load_dataset(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(raised, match=r"hub dataset 'someone/some_corpus'.*pass a local path"):
        open_corpus("someone/some_corpus")


def test_hub_dataset_online_streams_its_text_column(monkeypatch):
    import datasets

    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return datasets.Dataset.from_dict({"text": ["one", None, "two"], "n": [1, 2, 3]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    corpus = open_corpus("someone/some_corpus", max_bytes=5)
    assert list(corpus.documents()) == ["one", "tw"] and corpus.description == "hub:someone/some_corpus:train"
    assert calls == [("someone/some_corpus", None, "train", True)]
    with pytest.raises(ValueError, match=r"no column 'body'; the columns are \['n', 'text'\]"):
        open_corpus("someone/some_corpus", text_field="body")
