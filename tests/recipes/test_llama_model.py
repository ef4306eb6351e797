"""The LLaMA recipe's model computes what ``transformers``' ``LlamaForCausalLM`` computes with the same weights.

An independent reference: Hugging Face's implementation (its own RMSNorm,
rotary embedding, grouped-query attention and SwiGLU), loaded with our
state dict by name, strictly. Compared in float32 to 1e-5 relative: the
logits, the loss and every parameter's gradient, at a sequence shorter than
the rotary table (its rows are sliced, not recomputed).
"""
from __future__ import annotations

import pytest
import torch

from recipes.llama.model import LlamaConfig, LlamaForCausalLM
from toolkit.plain_loop import materialized

transformers = pytest.importorskip("transformers")

DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=24, rms_norm_eps=1e-5, rope_theta=500000.0)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# Llama 3.1's rotary scaling over an original context of 16 positions: with head_dim 16 and this theta, some
# frequencies are kept, some interpolated and the rest divided by the factor.
LLAMA3_ROPE = dict(rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_position_embeddings=16)


def _their_scaling(ours: dict) -> dict:
    return {"rope_scaling": {"rope_type": "llama3", "factor": ours["rope_factor"],
                             "low_freq_factor": ours["rope_low_freq_factor"],
                             "high_freq_factor": ours["rope_high_freq_factor"],
                             "original_max_position_embeddings": ours["rope_original_max_position_embeddings"]}}


TIED = dict(tie_word_embeddings=True)
QWEN2 = dict(qkv_bias=True, tie_word_embeddings=True)  # Qwen2.5 0.5B's kind
QWEN3 = dict(head_dim=24, qk_norm=True, tie_word_embeddings=True)  # Qwen3 0.6B's kind: heads wider than width / heads
OLMO2 = dict(qk_norm=True, qk_norm_over="projection", post_norm=True)  # norms over the projections, after each block


@pytest.mark.parametrize("kind, kv_heads, rope", [
    ("llama", 4, {}), ("llama", 2, {}), ("llama", 1, {}), ("llama", 2, LLAMA3_ROPE), ("llama", 2, TIED),
    ("mistral", 2, {}), ("mistral", 2, {"sliding_window": 8}), ("qwen2", 2, QWEN2), ("qwen3", 2, QWEN3),
    ("olmo2", 2, OLMO2)],
    ids=["multi-head", "grouped-query", "multi-query", "llama3-rope", "tied-embeddings", "mistral", "mistral-window",
         "qwen2", "qwen3", "olmo2"])
def test_logits_loss_and_gradients_match_transformers(kind, kv_heads, rope):
    """Against transformers' Llama, Mistral (without a sliding window, and with one of 8 positions on a sequence of
    20), Qwen2 (query, key and value biases, here drawn
    from N(0, 0.1) so that each bias counts), Qwen3 (heads of 24 on a width of 64, each query and key head
    RMS-normalised) and OLMo 2 (norms over the whole query and key projections, and after the attention and the
    MLP instead of before them). Every norm's weight is drawn from N(1, 0.1), so that a weight loaded into
    another norm's place shows. With tied embeddings the one weight's gradient sums the embedding's and the LM
    head's."""
    torch.manual_seed(0)
    ours = LlamaForCausalLM(LlamaConfig(**DIMS, num_key_value_heads=kv_heads, **rope))
    tied = rope.get("tie_word_embeddings", False)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM)}[kind]
    window = {"sliding_window": rope.get("sliding_window") or None} if kind == "mistral" else {"head_dim": 24} \
        if kind == "qwen3" else {}
    if kind == "olmo2":  # its default padding row would get no gradient; ours has none
        window = {"pad_token_id": None, "eos_token_id": None}
    theirs = model_class(config_class(
        **DIMS, num_key_value_heads=kv_heads, tie_word_embeddings=tied, attn_implementation="eager", **window,
        **(_their_scaling(rope) if "rope_factor" in rope else {})))
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, DIMS["vocab_size"], (3, 20))
    logits, loss = ours(ids, ids)
    out = theirs(input_ids=ids, labels=ids)
    loss.backward()
    out.loss.backward()
    assert _rel(logits, out.logits) < 1e-5 and _rel(loss, out.loss) < 1e-5
    grads = dict(theirs.named_parameters())
    worst = max(_rel(p.grad, grads[n].grad) for n, p in ours.named_parameters())
    assert worst < 1e-5, worst


def _hf_dir(tmp_path, **changes):
    """A tiny ``transformers`` Llama saved as Hugging Face saves it (config.json + model.safetensors)."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**{**DIMS, "num_key_value_heads": 2, "tie_word_embeddings": False, **changes})
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return model


def _model_cfg(**changes):
    from omegaconf import OmegaConf

    from recipes.llama.config import ModelConfig

    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {**DIMS, "num_key_value_heads": 2, **changes})


def test_a_hugging_face_directory_loads_into_a_pipeline_stage(tmp_path):
    """``trainer.init_from``'s path: each stage, built on the meta device, gets the directory's weights; the
    whole model so loaded computes Hugging Face's logits."""
    from recipes.llama.recipe import RECIPE
    from toolkit.stages import keep_stage, stage_ranges

    from omegaconf import OmegaConf

    theirs = _hf_dir(tmp_path).eval()
    cfg = OmegaConf.create({"model": _model_cfg()})
    assert RECIPE.reads_weights(str(tmp_path)) and RECIPE.weights_problems(str(tmp_path), cfg) == []
    whole = RECIPE.build_stage(cfg.model, lambda m: m)
    assert RECIPE.init_weights(whole, str(tmp_path), cfg)
    assert all(p.is_meta for p in whole.parameters())  # nothing is read until distribute_module asks
    materialized(whole)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 12))
    with torch.no_grad():
        assert _rel(whole(ids)[0], theirs(input_ids=ids).logits) < 1e-5
    last = RECIPE.build_stage(cfg.model, lambda m: keep_stage(m, RECIPE.pipeline, stage_ranges(2, 2), 1))
    assert RECIPE.init_weights(last, str(tmp_path), cfg)
    assert last.model.embed_tokens is None
    assert torch.equal(materialized(last).lm_head.weight, theirs.lm_head.weight)


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    (_their_scaling(LLAMA3_ROPE), "rope_factor=8.0, rope_original_max_position_embeddings=16, the model "
                                  "rope_factor=1.0, rope_original_max_position_embeddings=8192"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True, the model tie_word_embeddings=False"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"num_hidden_layers": 3}, "num_hidden_layers=3, the model num_hidden_layers=2"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
])
def test_what_our_model_lacks_is_refused_from_the_config_alone(changes, message, tmp_path):
    from recipes.llama.hf import hf_dir_problems

    _hf_dir(tmp_path, **changes)
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # the check reads config.json and file names only
    assert any(message in p for p in hf_dir_problems(str(tmp_path), _model_cfg())), \
        hf_dir_problems(str(tmp_path), _model_cfg())


def test_a_tied_hugging_face_directory_loads_into_every_stage_and_exports_back(tmp_path):
    """Llama 3.2's kind: the files hold the embedding (and maybe a stale copy under the head's name); the last
    stage's LM head gets the embedding, the whole model ties the two names to one tensor again, and
    ``hf_config`` says the head is tied."""
    from safetensors.torch import load_file

    from recipes.llama.hf import hf_config
    from recipes.llama.recipe import RECIPE
    from toolkit.stages import keep_stage, stage_ranges

    from omegaconf import OmegaConf

    from safetensors.torch import save_file

    theirs = _hf_dir(tmp_path, **TIED).eval()
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    # A file that keeps another copy under the head's name: tied, the embedding is what every stage reads.
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    cfg = OmegaConf.create({"model": _model_cfg(**TIED)})
    assert RECIPE.weights_problems(str(tmp_path), cfg) == []
    assert RECIPE.tied_pairs(cfg.model) == (("model.embed_tokens.weight", "lm_head.weight"),)
    whole = RECIPE.build_stage(cfg.model, lambda m: m)
    assert RECIPE.init_weights(whole, str(tmp_path), cfg)
    assert materialized(whole).lm_head.weight is whole.model.embed_tokens.weight
    ids = torch.randint(0, DIMS["vocab_size"], (2, 12))
    with torch.no_grad():
        assert _rel(whole(ids)[0], theirs(input_ids=ids).logits) < 1e-5
    last = RECIPE.build_stage(cfg.model, lambda m: keep_stage(m, RECIPE.pipeline, stage_ranges(2, 2), 1))
    assert RECIPE.init_weights(last, str(tmp_path), cfg) and last.model.embed_tokens is None
    assert torch.equal(materialized(last).lm_head.weight, theirs.model.embed_tokens.weight)
    ours = {**LlamaConfig(**DIMS, num_key_value_heads=2, **TIED).__dict__}
    assert transformers.LlamaConfig(**hf_config(ours)).tie_word_embeddings


@pytest.mark.parametrize("fmt", ["safetensors", "bin", "sharded"])
def test_a_rank_reads_only_the_boxes_it_keeps(fmt, tmp_path):
    """``ShardReader.read``: a box of each parameter (a tp rank's rows of ``q_proj``, a column block of
    ``o_proj``), equal to that box of Hugging Face's tensor, from one safetensors file, a ``.bin`` or an
    index of shards; a name the files lack is refused before any is read."""
    from recipes.llama.hf import ShardReader
    from recipes.llama.recipe import RECIPE

    torch.manual_seed(1)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **DIMS, num_key_value_heads=2, tie_word_embeddings=False)).to(torch.bfloat16)
    theirs.save_pretrained(tmp_path, max_shard_size="100KB" if fmt == "sharded" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (fmt == "sharded")
    if fmt == "bin":  # transformers 5 writes safetensors only: an older directory's pytorch_model.bin
        torch.save({k: v.clone() for k, v in theirs.state_dict().items()}, tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    with torch.device("meta"):
        ours = RECIPE.build_model(_model_cfg())
    reader = ShardReader(str(tmp_path), ours, _model_cfg())
    sd = theirs.state_dict()
    q = reader.read("model.layers.1.self_attn.q_proj.weight", ((32, 32), (0, 64)))
    assert q.dtype == torch.float32 and torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"][32:].float())
    o = reader.read("model.layers.0.self_attn.o_proj.weight", ((0, 64), (16, 16)))
    assert torch.equal(o, sd["model.layers.0.self_attn.o_proj.weight"][:, 16:32].float())
    with torch.device("meta"):
        deeper = RECIPE.build_model(_model_cfg(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"no weights for \['model.layers.2."):
        ShardReader(str(tmp_path), deeper, _model_cfg())


def _loaded(path, cfg):
    """The whole model of ``cfg.model`` with the Hugging Face directory ``path``'s weights, which it accepts
    (``trainer.init_from``'s path: checked, then read as ``distribute_module`` would)."""
    from recipes.llama.hf import hf_dir_problems
    from recipes.llama.recipe import RECIPE

    assert hf_dir_problems(str(path), cfg.model) == []
    whole = RECIPE.build_stage(cfg.model, lambda m: m)
    assert RECIPE.init_weights(whole, str(path), cfg)
    return materialized(whole)


def test_qwen2_and_mistral_directories_load_and_a_qwen2_model_exports_as_one(tmp_path):
    """A Qwen2 directory loads into a model with ``qkv_bias`` (and is refused, naming the key, into one without),
    unless it uses a sliding window; a Mistral one without a window shorter than its context loads as Llama's
    decoder, one with a window into a model with that ``sliding_window``, which exports as a Mistral
    directory. ``hf_config`` of a ``qkv_bias`` model writes a Qwen2 directory transformers computes our logits
    from."""
    from omegaconf import OmegaConf

    from recipes.gpt2.hf import write_hf_dir
    from recipes.llama.hf import hf_config, hf_dir_problems
    from recipes.llama.recipe import RECIPE

    def saved(path, config_class, model_class, **changes):
        torch.manual_seed(1)
        model = model_class(config_class(**{**DIMS, "num_key_value_heads": 2, **changes}))
        model.save_pretrained(path)
        return model.eval()

    qwen2 = saved(tmp_path / "qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **TIED)
    cfg = OmegaConf.create({"model": _model_cfg(**QWEN2)})
    assert any("qkv_bias=True, the model qkv_bias=False" in p
               for p in hf_dir_problems(str(tmp_path / "qwen2"), _model_cfg(**TIED)))
    ids = torch.randint(0, DIMS["vocab_size"], (2, 12))
    with torch.no_grad():
        assert _rel(_loaded(tmp_path / "qwen2", cfg)(ids)[0], qwen2(input_ids=ids).logits) < 1e-5
    saved(tmp_path / "windowed", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, use_sliding_window=True,
          sliding_window=8)
    assert any("use_sliding_window=true" in p for p in hf_dir_problems(str(tmp_path / "windowed"), cfg.model))
    saved(tmp_path / "layers", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, sliding_window=8,
          layer_types=["full_attention", "sliding_attention"])
    assert any("sliding_attention" in p for p in hf_dir_problems(str(tmp_path / "layers"), cfg.model))
    mistral = saved(tmp_path / "mistral", transformers.MistralConfig, transformers.MistralForCausalLM,
                    sliding_window=None, head_dim=16)
    assert hf_dir_problems(str(tmp_path / "mistral"), _model_cfg()) == []
    windowed = saved(tmp_path / "mistral-window", transformers.MistralConfig, transformers.MistralForCausalLM,
                     sliding_window=16, head_dim=16)
    assert any("sliding_window=16, the model sliding_window=0" in p
               for p in hf_dir_problems(str(tmp_path / "mistral-window"), _model_cfg()))
    longer = torch.randint(0, DIMS["vocab_size"], (2, 20))  # past the window
    window_cfg = OmegaConf.create({"model": _model_cfg(sliding_window=16)})
    with torch.no_grad():
        mine = _loaded(tmp_path / "mistral-window", window_cfg)
        assert _rel(mine(longer)[0], windowed(input_ids=longer).logits) < 1e-5
    write_hf_dir(str(tmp_path / "window-out"), hf_config(dict(mine.config.__dict__)), mine.state_dict())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "window-out").eval()
    assert isinstance(back, transformers.MistralForCausalLM) and back.config.sliding_window == 16
    with torch.no_grad():
        assert _rel(mine(longer)[0], back(input_ids=longer).logits) < 1e-5
    cfg = OmegaConf.create({"model": _model_cfg()})
    plain = RECIPE.build_stage(cfg.model, lambda m: m)
    assert RECIPE.init_weights(plain, str(tmp_path / "mistral"), cfg)
    with torch.no_grad():
        assert _rel(materialized(plain)(ids)[0], mistral(input_ids=ids).logits) < 1e-5

    ours = LlamaForCausalLM(LlamaConfig(**DIMS, num_key_value_heads=2, **QWEN2)).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    state = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding alone
    write_hf_dir(str(tmp_path / "out"), hf_config(dict(ours.config.__dict__)), state)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(back, transformers.Qwen2ForCausalLM)
    with torch.no_grad():
        assert _rel(ours(ids)[0], back(input_ids=ids).logits) < 1e-5


def test_a_qwen3_directory_loads_into_a_model_with_its_norms_and_heads_and_exports_as_one(tmp_path):
    """A Qwen3 directory (heads of 24 on a width of 64) loads into a model with ``qk_norm`` and ``head_dim=24`` and
    is refused, naming both, into one without; ``hf_config`` of such a model writes a Qwen3 directory whose logits
    transformers computes as ours. Its ``attention_bias`` (biases on all four projections) is refused."""
    from omegaconf import OmegaConf

    from recipes.gpt2.hf import write_hf_dir
    from recipes.llama.hf import hf_config, hf_dir_problems

    torch.manual_seed(1)
    theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DIMS, num_key_value_heads=2, head_dim=24,
                                                                    tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.1)
    theirs.save_pretrained(tmp_path / "qwen3")
    assert any("head_dim=24, qk_norm=True, the model head_dim=16, qk_norm=False" in p
               for p in hf_dir_problems(str(tmp_path / "qwen3"), _model_cfg(**TIED)))
    cfg = OmegaConf.create({"model": _model_cfg(**QWEN3)})
    whole = _loaded(tmp_path / "qwen3", cfg)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 12))
    with torch.no_grad():
        assert _rel(whole(ids)[0], theirs.eval()(input_ids=ids).logits) < 1e-5
    state = {k: v for k, v in whole.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding alone
    write_hf_dir(str(tmp_path / "out"), hf_config(dict(whole.config.__dict__)), state)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(back, transformers.Qwen3ForCausalLM) and back.config.head_dim == 24
    with torch.no_grad():
        assert _rel(whole(ids)[0], back(input_ids=ids).logits) < 1e-5
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DIMS, num_key_value_heads=2, head_dim=24,
                                                           attention_bias=True)).save_pretrained(tmp_path / "biased")
    assert any("attention_bias=true" in p for p in hf_dir_problems(str(tmp_path / "biased"), cfg.model))


def test_an_olmo2_directory_loads_into_a_post_norm_model_and_exports_as_one(tmp_path):
    """An OLMo 2 directory (grouped-query attention, every norm's weight drawn) loads into a model with
    ``post_norm`` and query/key norms over the projections, and is refused, naming them, into one without;
    ``hf_config`` of such a model writes an OLMo 2 directory whose logits transformers computes as ours. Its
    ``attention_bias`` is refused."""
    from omegaconf import OmegaConf

    from recipes.gpt2.hf import write_hf_dir
    from recipes.llama.hf import hf_config, hf_dir_problems

    torch.manual_seed(1)
    theirs = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**DIMS, num_key_value_heads=2, pad_token_id=None,
                                                                    eos_token_id=None))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    theirs.save_pretrained(tmp_path / "olmo2")
    assert any("qk_norm=True, qk_norm_over=projection, post_norm=True, the model qk_norm=False, qk_norm_over=head, "
               "post_norm=False" in p for p in hf_dir_problems(str(tmp_path / "olmo2"), _model_cfg()))
    cfg = OmegaConf.create({"model": _model_cfg(**OLMO2)})
    whole = _loaded(tmp_path / "olmo2", cfg)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 12))
    with torch.no_grad():
        assert _rel(whole(ids)[0], theirs.eval()(input_ids=ids).logits) < 1e-5
    write_hf_dir(str(tmp_path / "out"), hf_config(dict(whole.config.__dict__)), whole.state_dict())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(back, transformers.Olmo2ForCausalLM)
    with torch.no_grad():
        assert _rel(whole(ids)[0], back(input_ids=ids).logits) < 1e-5
    transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**DIMS, attention_bias=True, pad_token_id=None,
                                                           eos_token_id=None)).save_pretrained(
        tmp_path / "biased")
    assert any("attention_bias=true" in p for p in hf_dir_problems(str(tmp_path / "biased"), cfg.model))


def _olmoe_attention_on_tp2():
    """Rank side: OLMoE's attention (norms over the whole query and key projections, their weights drawn) on tp2
    with the recipe's plan, float64; the collectives of its forward, its output's SBP, output and gradients."""
    import sbp_core as sc
    from recipes.llama.plan import QK_NORM_PROJECTION, TENSOR_PARALLEL
    from sbp_core.sbp import Broadcast

    att, x, cos, sin = _olmoe_attention()
    p = sc.placement("cpu", [0, 1])
    plan = {k.replace("*.self_attn.", ""): v for k, v in {**TENSOR_PARALLEL, **QK_NORM_PROJECTION}.items()
            if k.startswith("*.self_attn.")}
    sc.distribute_module(att, p, plan)
    xg, cos, sin = (sc.distribute(t, p, (Broadcast(),)) for t in (x, cos, sin))
    xg.requires_grad_()
    with sc.comm_ledger() as ledger:
        y = att(xg, cos, sin)
    sbp = str(y.sbp)
    y.sum().backward()
    grads = {n: q.grad.full_tensor() for n, q in att.named_parameters()}
    return [(r.op, r.bytes) for r in ledger.records], sbp, y.full_tensor(), {**grads, "x": xg.grad.full_tensor()}


def _olmoe_attention():
    from recipes.llama.model import Attention

    torch.manual_seed(0)
    att = Attention(LlamaConfig(**DIMS, num_key_value_heads=2, qk_norm=True, qk_norm_over="projection")).double()
    with torch.no_grad():
        att.q_norm.weight.normal_(1.0, 0.3)
        att.k_norm.weight.normal_(1.0, 0.3)
    x = torch.randn(2, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    angles = torch.outer(torch.arange(8.0), torch.rand(8, generator=torch.Generator().manual_seed(2))).double()
    return att, x, torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def test_olmoe_norms_over_tp_split_projections_reduce_one_value_per_position():
    """OLMoE's query and key norms over projections split by head on tp2: each norm's mean of squares is reduced
    across the ranks, [2, 8, 1] float64 (a reduce-scatter and an all-gather of 64 bytes each), and nothing else
    moves in forward (the output stays partial for the residual add). Values and gradients: one device's."""
    from toolkit.rank_pool import get_pool

    ops, sbp, y, grads = get_pool(2).run(_olmoe_attention_on_tp2)[0]
    assert ops == [("reduce_scatter", 64), ("all_gather", 64)] * 2 and sbp == "(P(sum),)", (ops, sbp)
    att, x, cos, sin = _olmoe_attention()
    x.requires_grad_()
    want = att(x, cos, sin)
    want.sum().backward()
    assert _rel(y, want) < 1e-12
    for n, q in [*att.named_parameters(), ("x", x)]:
        assert _rel(grads[n], q.grad) < 1e-12, n


def test_the_recipe_splits_norms_over_the_projections_with_the_heads_and_not_per_head_norms():
    """The recipe's plan (what ``train.py`` lays out): OLMoE's norms ``(B, S(0))`` on ``(dp, tp)``, Qwen3's per-head
    norms left to the default ``B`` (their weight is one head's)."""
    from omegaconf import OmegaConf

    from recipes.llama.recipe import RECIPE

    def plan(over):
        cfg = OmegaConf.create({"model": _model_cfg(qk_norm=True, qk_norm_over=over),
                                "parallel": {"sequence_parallel": False}})
        return RECIPE.mesh_plan(cfg)

    from sbp_core.sbp import Broadcast, Split

    split = ("*.self_attn.q_norm.weight", "*.self_attn.k_norm.weight")
    assert all(plan("projection")[k] == (Broadcast(), Split(0)) for k in split), plan("projection")
    assert not any(k in plan("head") for k in split)


def _forward_collectives(post_norm: bool, sequence_parallel: bool):
    """Rank side: a 2-layer model with norms over the query/key projections, pre-norm (LLaMA's layer) or post-norm
    (OLMo 2's), laid out on tp2 by the recipe's plan (its tp axis), float64; the collectives of its forward and
    loss, ``(op, bytes)`` in order."""
    from omegaconf import OmegaConf

    import sbp_core as sc
    from recipes.llama.recipe import RECIPE
    from sbp_core.sbp import Broadcast

    changes = {"qk_norm": True, "qk_norm_over": "projection", "post_norm": post_norm}
    cfg = OmegaConf.create({"model": _model_cfg(**changes), "parallel": {"sequence_parallel": sequence_parallel}})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DIMS, num_key_value_heads=2, **changes)).double()
    sc.distribute_module(model, sc.placement("cpu", [0, 1]), {k: v[1] for k, v in RECIPE.mesh_plan(cfg).items()})
    ids = sc.distribute(torch.randint(0, DIMS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1)),
                        model.lm_head.weight.placement, (Broadcast(),))
    with sc.comm_ledger() as ledger:
        model(ids, ids)
    return [(r.op, r.bytes) for r in ledger.records]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["whole", "sequence-parallel"])
def test_a_post_norm_layer_costs_the_collectives_of_a_pre_norm_one(sequence_parallel):
    """OLMo 2's layer on tp2 moves what LLaMA's does (Megatron's two reductions a layer, or two all-gathers and
    two reduce-scatters with the sequence split), not one more reduction per block input: its residual stream is
    pinned at the embedding's output, whole or sequence-split, where no norm reads it."""
    from toolkit.rank_pool import get_pool

    pre = get_pool(2).run(_forward_collectives, False, sequence_parallel)[0]
    post = get_pool(2).run(_forward_collectives, True, sequence_parallel)[0]
    assert sorted(post) == sorted(pre), (pre, post)
    stream = 2 * 8 * DIMS["hidden_size"] * 8  # [2, 8, 64] float64
    kinds = ("reduce_scatter", "all_gather") if sequence_parallel else ("all_reduce",)
    moved = [op for op, size in post if size in (stream, stream // 2)]
    layers = DIMS["num_hidden_layers"]
    assert all(moved.count(op) == 2 * layers + 1 for op in kinds) and set(moved) == set(kinds), moved


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_recipe_pins_a_post_norm_layers_residual_stream_at_its_norms_and_blocks(sequence_parallel):
    """OLMo 2's layer (``post_norm``): the plan's pins name the modules it has (``plan_for_module`` refuses a key
    that matches nothing); the norms after the attention and the MLP, and the embedding's output where the stream
    starts, are whole on tp, or split on the sequence with ``sequence_parallel``; the attention and the MLP read
    it whole."""
    from omegaconf import OmegaConf

    from recipes.llama.recipe import RECIPE
    from sbp_core.sbp import Broadcast, Split
    from toolkit.mesh import model_names, plan_for_module

    cfg = OmegaConf.create({"model": _model_cfg(**OLMO2), "parallel": {"sequence_parallel": sequence_parallel}})
    model = RECIPE.build_model(cfg.model)
    plan = plan_for_module(model, RECIPE.mesh_plan(cfg), model_names(model))
    stream = Split(1) if sequence_parallel else Broadcast()
    for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
        assert plan[f"*.{norm}:input"] == (Split(0), stream), plan
    assert plan["model.embed_tokens:output"] == (Split(0), stream)
    assert plan["*.self_attn:input"] == plan["*.mlp:input"] == (Split(0), Broadcast())
    assert not any("input_layernorm" in k for k in plan)


def test_keys_a_config_leaves_out_take_transformers_defaults():
    from recipes.llama.hf import _hf_value, unsupported

    minimal = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "hidden_act": "swish"}
    assert unsupported(minimal) == []
    assert [_hf_value(minimal, k) for k in ("num_key_value_heads", "rms_norm_eps", "rope_theta")] == [4, 1e-6, 1e4]
    # transformers 5 writes rope_parameters; its theta wins over a stale top-level one
    assert _hf_value({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                     "rope_theta") == 5e5
    defaults = transformers.LlamaConfig()
    assert defaults.rms_norm_eps == 1e-6 and defaults.max_position_embeddings == 2048
    for kind, config in (("mistral", transformers.MistralConfig()), ("qwen2", transformers.Qwen2Config())):
        minimal = {"model_type": kind}
        for key in ("vocab_size", "intermediate_size", "num_key_value_heads", "max_position_embeddings"):
            assert _hf_value(minimal, key) == getattr(config, key), (kind, key)
    assert _hf_value({"model_type": "mistral"}, "sliding_window") == transformers.MistralConfig().sliding_window
    mixtral = transformers.MixtralConfig()
    for key in ("vocab_size", "intermediate_size", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                "num_local_experts", "num_experts_per_tok"):
        assert _hf_value({"model_type": "mixtral"}, key) == getattr(mixtral, key), key
    assert _hf_value({"model_type": "mixtral"}, "rope_theta") == mixtral.rope_parameters["rope_theta"]
    assert _hf_value({"model_type": "llama"}, "num_local_experts") == 0  # a dense MLP
    for key in ("vocab_size", "intermediate_size", "num_key_value_heads", "max_position_embeddings", "head_dim"):
        assert _hf_value({"model_type": "qwen3", "num_attention_heads": 16}, key) == getattr(
            transformers.Qwen3Config(num_attention_heads=16), key), key
    assert _hf_value({"model_type": "qwen3"}, "qk_norm") and not _hf_value({"model_type": "qwen2"}, "qk_norm")
    for kind, config in (("qwen2_moe", transformers.Qwen2MoeConfig(num_attention_heads=8)),
                         ("qwen3_moe", transformers.Qwen3MoeConfig(num_attention_heads=8))):
        minimal = {"model_type": kind, "num_attention_heads": 8}  # other heads than the default
        for ours, theirs in (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "num_experts"),
                             ("num_experts_per_tok", "num_experts_per_tok"), ("norm_topk_prob", "norm_topk_prob"),
                             ("num_key_value_heads", "num_key_value_heads"), ("hidden_size", "hidden_size"),
                             ("num_hidden_layers", "num_hidden_layers"), ("vocab_size", "vocab_size"),
                             ("max_position_embeddings", "max_position_embeddings"), ("rms_norm_eps", "rms_norm_eps")):
            assert _hf_value(minimal, ours) == getattr(config, theirs), (kind, ours)
        assert _hf_value(minimal, "head_dim") == config.hidden_size // 8
        assert _hf_value(minimal, "qkv_bias") == (kind == "qwen2_moe")  # Qwen2-MoE's by default; Qwen3's refused
    olmoe = transformers.OlmoeConfig()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads",
                "max_position_embeddings", "rms_norm_eps", "num_experts_per_tok", "norm_topk_prob"):
        assert _hf_value({"model_type": "olmoe"}, key) == getattr(olmoe, key), key
    assert _hf_value({"model_type": "olmoe"}, "num_local_experts") == olmoe.num_experts
    assert _hf_value({"model_type": "olmoe"}, "qk_norm_over") == "projection"
    olmo2 = transformers.Olmo2Config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert _hf_value({"model_type": "olmo2"}, key) == getattr(olmo2, key), key
    assert _hf_value({"model_type": "olmo2"}, "rope_theta") == olmo2.rope_parameters["rope_theta"]
    assert [_hf_value({"model_type": "olmo2"}, k) for k in ("qk_norm", "qk_norm_over", "post_norm")] == [
        True, "projection", True]
    assert not _hf_value({"model_type": "olmoe"}, "post_norm")
    assert _hf_value({"model_type": "qwen2_moe"}, "shared_expert_intermediate_size") == \
        transformers.Qwen2MoeConfig().shared_expert_intermediate_size
    # Mixtral's renormalisation and lack of a shared expert are its model's, whatever a config.json says
    assert _hf_value({"model_type": "mixtral", "norm_topk_prob": False}, "norm_topk_prob") is True
    assert unsupported({"model_type": "qwen2_moe", "num_experts": 0}) != []


@pytest.mark.parametrize("changes, message", [
    ({"qk_norm": True, "qkv_bias": True}, "query/key norms and a shared expert or query/key/value biases"),
    ({"num_local_experts": 4, "norm_topk_prob": False}, "experts, no shared expert, and query/key/value biases or "
                                                        "unnormalised routing weights"),
    ({"num_local_experts": 4, "qkv_bias": True}, "experts, no shared expert, and query/key/value biases"),
    ({"qk_norm": True, "qk_norm_over": "projection"}, "query/key norms over the whole projections but no experts"),
    ({"post_norm": True}, "norms after the attention and the MLP but not query/key norms over the whole projections"),
    ({"sliding_window": 8, "qkv_bias": True}, "sliding window of 8 and query/key norms, query/key/value biases"),
    ({"post_norm": True, "qk_norm": True, "qk_norm_over": "projection", "num_local_experts": 4},
     "norms after the attention and the MLP .* or has experts"),
])
def test_a_model_no_hugging_face_type_has_is_refused_on_export(changes, message):
    from recipes.llama.hf import hf_config

    with pytest.raises(ValueError, match=message):
        hf_config(vars(LlamaConfig(**DIMS, **changes)))


def test_llama3_rotary_scaling_loads_when_the_model_has_it_and_exports_back(tmp_path):
    """A Llama 3.1-style directory passes the check with the model's ``rope_*`` keys set, and ``hf_config`` of
    such a model is a config transformers reads with the same scaling."""
    from recipes.llama.hf import hf_config, hf_dir_problems
    from recipes.llama.model import LlamaConfig as Ours

    _hf_dir(tmp_path, **_their_scaling(LLAMA3_ROPE))
    assert hf_dir_problems(str(tmp_path), _model_cfg(**LLAMA3_ROPE)) == []
    ours = {**Ours(**DIMS, num_key_value_heads=2, **LLAMA3_ROPE).__dict__}
    config = transformers.LlamaConfig(**hf_config(ours))
    theirs = config.rope_parameters
    assert theirs["rope_type"] == "llama3" and theirs["factor"] == 8.0
    assert theirs["original_max_position_embeddings"] == 16 and theirs["rope_theta"] == DIMS["rope_theta"]
