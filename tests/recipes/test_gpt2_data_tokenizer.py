"""Byte-level BPE: exact vocabulary size, exact round trips, trained once per (corpus, size)."""
from __future__ import annotations

import os

import pytest

from recipes.gpt2.data import tokenizer as tokenizer_module
from recipes.gpt2.data.corpus import stdlib_corpus
from recipes.gpt2.data.source import open_corpus
from recipes.gpt2.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer

CAP, VOCAB = 300_000, 512
TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "héllo wörld — ünïcødé 🎉 中文\r\n\ttabs  and   spaces",
    "a literal <|endoftext|> inside a document stays text",
    "",
    " leading space and trailing \n\n",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tok")
    return train_tokenizer(stdlib_corpus(CAP), VOCAB, str(cache)), str(cache)


def test_exact_vocab_size_with_contiguous_ids(trained):
    tok, _ = trained
    assert tok.vocab_size == VOCAB
    assert sorted(tok.tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(VOCAB))
    assert tok.eos_id == 0 and tok.tokenizer.id_to_token(0) == EOS_TOKEN


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(trained, text):
    tok, _ = trained
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_id not in ids  # the separator is never produced by text
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_merges_compress_python_source(trained):
    tok, _ = trained
    text = "import os\n\n\ndef main():\n    return os.path.join(a, b)\n"
    assert len(tok.encode(text)) < 0.75 * len(text.encode("utf-8"))  # 255 merges already pay


def test_cache_hit_loads_without_training(trained, monkeypatch):
    tok, cache = trained
    mtime = os.stat(tok.path).st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer must be loaded, not retrained")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    again = train_tokenizer(stdlib_corpus(CAP), VOCAB, cache)
    assert again.path == tok.path and again.digest == tok.digest
    assert os.stat(tok.path).st_mtime_ns == mtime
    assert [d for d in os.listdir(cache) if not d.endswith(".lock")] == [os.path.basename(os.path.dirname(tok.path))]


def test_small_corpus_is_padded_to_the_exact_size(tmp_path):
    (tmp_path / "tiny.txt").write_text("ab ab ab ba")
    tok = train_tokenizer(open_corpus(str(tmp_path / "tiny.txt")), 300, str(tmp_path / "cache"))
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    assert tok.vocab_size == 300 and sorted(vocab.values()) == list(range(300))
    assert "<|unused_0|>" in vocab
    assert tok.decode(tok.encode("ba ab x")) == "ba ab x"


def test_load_existing_tokenizer_file_or_directory(trained):
    tok, _ = trained
    by_file, by_dir = load_tokenizer(tok.path), load_tokenizer(os.path.dirname(tok.path))
    assert by_file.digest == by_dir.digest == tok.digest
    assert by_file.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_errors_name_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 257.*got 100"):
        train_tokenizer(stdlib_corpus(1000), 100, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer file at"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_weights_bring_their_tokenizer(trained, tmp_path):
    """``trainer.init_from``'s weights give the job their tokenizer unless ``data.tokenizer`` names one: a
    Hugging Face directory's own ``tokenizer.json``; for our checkpoint, the run directory's copy, looked for no
    further up than the run directory (the one holding ``config.yaml``)."""
    from omegaconf import OmegaConf

    from recipes.gpt2.data.tokenizer import tokenizer_of_weights
    from recipes.gpt2.recipe import RECIPE

    tok, _ = trained
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    tok.tokenizer.save(str(hf / "tokenizer.json"))
    assert tokenizer_of_weights(str(hf)) == str(hf / "tokenizer.json")
    run = tmp_path / "runs" / "a"
    step = run / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    assert tokenizer_of_weights(str(step)) is None  # the run directory has none, and the search stops there
    (tmp_path / "runs" / "tokenizer.json").write_text("{}")
    assert tokenizer_of_weights(str(step)) is None
    tok.tokenizer.save(str(run / "tokenizer.json"))
    assert tokenizer_of_weights(str(step)) == tokenizer_of_weights(str(run / "checkpoints")) == str(run / "tokenizer.json")

    def cfg(init_from, tokenizer=None):
        return OmegaConf.create({"trainer": {"init_from": init_from, "resume": "none"},
                                 "data": {"tokenizer": tokenizer}})

    assert RECIPE.tokenizer_path(cfg(str(hf))) == str(hf / "tokenizer.json")
    assert RECIPE.tokenizer_path(cfg(str(step))) == str(run / "tokenizer.json")
    assert RECIPE.tokenizer_path(cfg(str(hf), "/given/tokenizer.json")) == "/given/tokenizer.json"
    assert RECIPE.tokenizer_path(cfg(None)) is None


def test_a_resumed_run_keeps_its_own_tokenizer(tmp_path):
    """``trainer.resume=auto`` without ``data.tokenizer``: the copy the run keeps in its run directory, not
    one trained anew (on another ``data.path`` its ids would differ from the weights'); the first run of a
    directory, one without a checkpoint (stopped before its first save) or without the copy trains one."""
    from omegaconf import OmegaConf

    from toolkit import checkpoint as ckpt

    from recipes.gpt2.recipe import RECIPE

    def cfg(resume, tokenizer=None):
        return OmegaConf.create({"run_dir": str(tmp_path), "trainer": {"init_from": None, "resume": resume},
                                 "data": {"tokenizer": tokenizer}})

    assert RECIPE.tokenizer_path(cfg("auto")) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert RECIPE.tokenizer_path(cfg("auto")) is None  # no checkpoint: the run starts afresh, and trains one
    ckpt.save(str(tmp_path / "checkpoints"), 2, {"step": 2})
    assert RECIPE.tokenizer_path(cfg("auto")) == str(tmp_path / "tokenizer.json")
    assert RECIPE.tokenizer_path(cfg("none")) is None
    assert RECIPE.tokenizer_path(cfg("auto", "/given/tokenizer.json")) == "/given/tokenizer.json"
