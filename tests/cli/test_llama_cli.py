"""The LLaMA recipe trains like one device under tensor, sequence, context, pipeline (interleaved) and ZeRO layouts.

A tiny LLaMA (grouped-query attention: 4 query heads, 2 key/value heads) on
the GPT-2 tests' slice of the stdlib corpus (the same cached tokenizer and
token files), 3 steps, the same global batch in every layout; the per-step
losses equal ``single``'s. Bad dimensions fail before any process starts.
"""
from __future__ import annotations

import pytest

from recipes.registry import get
from tests.cli.pooled import assert_same_losses, one_process_run, refusal, train_pooled
from toolkit.config import ConfigError, compose, validate

TINY = ["recipe=llama", "model.num_hidden_layers=4", "model.hidden_size=64", "model.intermediate_size=96",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512",
        "model.max_position_embeddings=64", "data.max_bytes=300000", "trainer.global_batch_size=16",
        "trainer.micro_batch_size=2", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
        "logger=none", "trainer.peak_tflops=1"]


@pytest.fixture(scope="module")
def single_llama(tmp_path_factory, sbp_cache):
    """``(run directory, per-step losses)`` of the one-process run (it ends with a checkpoint)."""
    return one_process_run(tmp_path_factory, sbp_cache, "llama-single", TINY)


@pytest.fixture(scope="module")
def single(single_llama):
    return single_llama[1]


@pytest.mark.parametrize("layout", ["tp2 parallel.sequence_parallel=true", "tp2_pp2 parallel.pp_virtual=2",
                                    "dp2_tp2_zero3", "cp2_pp2 trainer.micro_batch_size=1"])
def test_layout_losses_equal_single(layout, single, sbp_cache, tmp_path):
    layout, *options = layout.split()
    losses = train_pooled([*TINY, f"parallel={layout}", *options], tmp_path, sbp_cache)
    assert len(single) == 3
    assert_same_losses(losses, single, layout)


@pytest.fixture(scope="module")
def single_tied(tmp_path_factory, sbp_cache):
    """``(run directory, per-step losses)`` of one process with the LM head tied to the embedding."""
    return one_process_run(tmp_path_factory, sbp_cache, "llama-tied", [*TINY, "model.tie_word_embeddings=true"])


def test_tied_embeddings_train_like_one_device(single_tied, single, sbp_cache, tmp_path):
    """The one weight of a tied LM head and embedding, drawn from the seed on the first and last stage of
    dp2_tp2_pp2 (its two gradients summed across stages): the losses equal one process's, and differ from the
    untied model's. (ZB-V, both copies on one rank: tests/runtime/test_pipeline_schedules.py.)"""
    layout = "dp2_tp2_pp2"
    losses = train_pooled([*TINY, "model.tie_word_embeddings=true", f"parallel={layout}"], tmp_path, sbp_cache)
    alone = single_tied[1]
    assert len(losses) == len(alone) == 3 and abs(alone[-1] - single[-1]) > 1e-3, (alone, single)
    for a, b in zip(losses, alone):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, losses, alone)


def test_a_tied_run_exports_with_the_embedding_alone(single_tied, tmp_path):
    """``convert_hf.py export`` of a tied run: ``tie_word_embeddings`` in config.json, no ``lm_head.weight`` in
    the weights, and transformers computes our logits."""
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from scripts.convert_hf import main as convert
    from toolkit import checkpoint as ckpt
    from toolkit.config import load_config

    run = single_tied[0]
    assert convert(["export", str(run), str(tmp_path / "hf")]) == 0
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.tie_word_embeddings
    cfg = load_config(str(run))
    recipe = get("llama")
    ours = recipe.build_model(cfg.model).eval()
    ckpt.load(ckpt.latest(str(run / "checkpoints")), {"model": ours.state_dict()}, tied=recipe.tied_pairs(cfg.model))
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        a, b = ours(ids)[0], theirs(input_ids=ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_resuming_a_tied_run_untied_is_refused_before_any_process_starts(single_tied):
    run = str(single_tied[0])
    resumed = [*TINY, "trainer.resume=auto", "trainer.max_steps=4"]
    assert validate(compose([*resumed, "model.tie_word_embeddings=true"], run_dir=run), get("llama")).world_size == 1
    with pytest.raises(ConfigError, match="model.tie_word_embeddings=False here, the run's newest checkpoint"):
        validate(compose(resumed, run_dir=run), get("llama"))


@pytest.mark.parametrize("overrides, message", [
    (["model.num_key_value_heads=3"], "model.num_key_value_heads=3: must divide model.num_attention_heads=4"),
    (["parallel=tp4"], "model.num_key_value_heads=2: must divide by parallel.tp=4 (whole key/value heads per rank)"),
    (["model.hidden_size=60"],
     "model.hidden_size=60: must divide by model.num_attention_heads=4 into an even head dim"),
    (["model.hidden_size=60", "model.head_dim=15"], "model.head_dim=15: must be even and > 0"),
    (["model.qk_norm=true", "model.qk_norm_over=heads"], "model.qk_norm_over='heads': valid: 'head'"),
    (["data.seq_len=128"], "data.seq_len=128: exceeds model.max_position_embeddings=64"),
    (["model.sliding_window=-1"], "model.sliding_window=-1: must be >= 0"),
])
def test_bad_dimensions_are_refused_before_any_process_starts(overrides, message, tmp_path):
    assert message in refusal([*TINY, *overrides], tmp_path)


def test_fine_tuning_from_a_hugging_face_directory_is_the_same_in_every_layout(single_llama, sbp_cache, tmp_path):
    """``trainer.init_from=<a LlamaForCausalLM directory>``: single and dp2_tp2_pp2 start from its weights (their
    first losses are not the seed's) and log the same losses. Without a ``tokenizer.json`` beside the weights
    (nor ``data.tokenizer``) the job is refused before any process starts."""
    import shutil

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.2)).save_pretrained(hf)
    tuned = [*TINY, f"trainer.init_from={hf}"]
    with pytest.raises(ConfigError, match="has no tokenizer.json, and a tokenizer trained on the corpus"):
        validate(compose(tuned, run_dir=str(tmp_path / "refused")), get("llama"))
    run, single = single_llama
    shutil.copyfile(run / "tokenizer.json", hf / "tokenizer.json")  # the ids the corpus is tokenized with
    alone = train_pooled([*tuned, "parallel=single"], tmp_path / "single", sbp_cache)
    split = train_pooled([*tuned, "parallel=dp2_tp2_pp2"], tmp_path / "split", sbp_cache)
    assert abs(alone[0] - single[0]) > 0.1, (alone, single)  # initializer_range 0.2: far from the seed's start
    assert_same_losses(split, alone)


@pytest.fixture(scope="module")
def qwen2_tuned(single_llama, sbp_cache, tmp_path_factory):
    """``(overrides, one process's losses)`` of fine-tuning a tiny Qwen2 directory: query, key and value biases,
    drawn at random here; the LM head tied, so its file holds the embedding alone."""
    import shutil

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(4)
    hf = tmp_path_factory.mktemp("qwen2")
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.2))
    with torch.no_grad():
        for name, p in qwen2.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    qwen2.save_pretrained(hf)
    shutil.copyfile(single_llama[0] / "tokenizer.json", hf / "tokenizer.json")
    tuned = [*TINY, f"trainer.init_from={hf}", "model.qkv_bias=true", "model.tie_word_embeddings=true",
             "model.rms_norm_eps=1e-5"]
    alone = train_pooled([*tuned, "parallel=single"], tmp_path_factory.mktemp("qwen2-single"), sbp_cache)
    assert abs(alone[0] - single_llama[1][0]) > 0.1, alone  # its weights, not the seed's
    return tuned, alone


@pytest.mark.parametrize("layout", ["dp2_tp2_pp2", "dp2_tp2_zero3"])
def test_fine_tuning_a_tied_qwen2_is_the_same_in_every_layout(layout, qwen2_tuned, sbp_cache, tmp_path):
    """Each rank reads its boxes of the Qwen2 files (under ZeRO-3, its slice of the masters; the last stage's LM
    head, the embedding's rows) and logs one process's losses."""
    tuned, alone = qwen2_tuned
    split = train_pooled([*tuned, f"parallel={layout}"], tmp_path, sbp_cache)
    for a, b in zip(split, alone):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, split, alone)


def test_generate_continues_a_prompt_from_a_llama_run(single_llama):
    import generate

    text = generate.main([f"run={single_llama[0]}", "prompt=def f(x):", "tokens=12", "seed=1"])
    assert text.startswith("def f(x):") and len(text) > len("def f(x):")


def exported(run, hf_dir, theirs_class: str, **model_changes) -> tuple:
    """``convert_hf.py export`` of ``run``'s last checkpoint into ``hf_dir``, loaded by ``transformers``'
    ``theirs_class``: ``(their model, our logits, theirs)`` on the same tokens, ours built from the run's
    config with ``model_changes`` and the checkpoint's weights."""
    transformers = pytest.importorskip("transformers")
    import torch

    from scripts.convert_hf import main as convert
    from toolkit import checkpoint as ckpt
    from toolkit.config import load_config

    assert convert(["export", str(run), str(hf_dir)]) == 0
    theirs = getattr(transformers, theirs_class).from_pretrained(hf_dir, experts_implementation="eager").eval()
    cfg = load_config(str(run))
    for key, value in model_changes.items():
        cfg.model[key] = value
    ours = get("llama").build_model(cfg.model).eval()
    ckpt.load(ckpt.latest(str(run / "checkpoints")), {"model": ours.state_dict()})
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        return theirs, ours(ids)[0], theirs(input_ids=ids).logits


def test_a_run_exports_as_a_directory_transformers_loads(single_llama, tmp_path):
    """``convert_hf.py export``: the run's last checkpoint as a ``LlamaForCausalLM`` directory (with the run's
    tokenizer), whose logits are our model's with the checkpoint's weights."""
    from recipes.gpt2.data.tokenizer import load_tokenizer

    run = single_llama[0]
    theirs, a, b = exported(run, tmp_path / "hf", "LlamaForCausalLM")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    eos = load_tokenizer(run / "tokenizer.json").eos_id
    assert eos is not None and theirs.config.eos_token_id == eos  # generate() stops where documents end
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
