"""``train.py recipe=llama model=mixtral-tiny``: Mixtral's sparse MLP trains like one device in a pipeline, with its
experts split over the data-parallel ranks under ZeRO-3 and with tensor parallelism (fine-tuning from a Hugging
Face directory: Mixtral's, Qwen2-MoE's, Qwen3-MoE's, OLMoE's); a run exports as one; what it does not do is refused
before any process starts.

The tiny LLaMA of ``test_llama_cli.py`` with 4 experts, 2 per token, a capacity that drops choices and a
load-balancing weight of 0.01, 3 steps; the per-step losses equal one process's.
"""
from __future__ import annotations

import pytest

from tests.cli.pooled import assert_same_losses, one_process_run, refusal, train_pooled
from tests.cli.test_llama_cli import TINY, exported

MIXTRAL = [*TINY, "model=mixtral-tiny", "model.capacity_factor=1.0", "model.router_aux_loss_coef=0.01"]


@pytest.fixture(scope="module")
def single_mixtral(tmp_path_factory, sbp_cache):
    """``(run directory, per-step losses)`` of the one-process run (it ends with a checkpoint)."""
    return one_process_run(tmp_path_factory, sbp_cache, "mixtral-single", MIXTRAL)


# The trainer's side of what the float64 pipeline of tests/runtime/test_pipeline_schedules.py checks (experts
# split over dp and tp under ZB-V): the load-balancing loss through a stage boundary the trainer
# finds on meta tensors, and ZeRO-3 leaving the split experts' masters as they are.
@pytest.mark.parametrize("layout", ["pp2", "dp2_zero3"])
def test_layouts_train_like_one_device(layout, single_mixtral, sbp_cache, tmp_path):
    layout, *options = layout.split()
    losses = train_pooled([*MIXTRAL, f"parallel={layout}", *options], tmp_path, sbp_cache)
    assert len(single_mixtral[1]) == 3
    assert_same_losses(losses, single_mixtral[1], layout)


DIMS = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, num_experts_per_tok=2,
            initializer_range=0.2)
QWEN_EXPERTS = {"intermediate_size": 128, "moe_intermediate_size": 96, "num_experts": 4}
# Each model type with experts: its config (what the export must say again) and our keys beyond the tiny Mixtral's.
EXPERTS = {
    # each expert's w1, w3, w2 apart under block_sparse_moe
    "Mixtral": ({"intermediate_size": 96, "num_local_experts": 4, "router_aux_loss_coef": 0.01}, []),
    # a gated shared expert (split on tp like a dense MLP), unnormalised routing weights, query/key/value biases
    "Qwen2Moe": ({**QWEN_EXPERTS, "shared_expert_intermediate_size": 80, "norm_topk_prob": False},
                 ["model.qkv_bias=true", "model.norm_topk_prob=false", "model.shared_expert_intermediate_size=80"]),
    # query and key norms (replicated on tp), heads of 24 on a width of 64 (96 query columns, split by head)
    "Qwen3Moe": ({**QWEN_EXPERTS, "head_dim": 24, "norm_topk_prob": True}, ["model.qk_norm=true", "model.head_dim=24"]),
    # norms over the whole query and key projections, split on tp with the heads (their sums of squares reduced)
    "Olmoe": ({"intermediate_size": 96, "num_experts": 4, "norm_topk_prob": False},
              ["model.qk_norm=true", "model.qk_norm_over=projection", "model.norm_topk_prob=false"]),
}


@pytest.mark.parametrize("kind", list(EXPERTS))
def test_fine_tuning_from_a_directory_is_the_same_with_the_experts_split_and_exports_back(
        kind, single_mixtral, sbp_cache, tmp_path):
    """``trainer.init_from=<a MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or OlmoeForCausalLM
    directory>`` (each
    expert's weights tensors of their own): one process and dp2_tp2 (each rank reading its two experts' halves)
    start from its weights and log the same losses, and the dp2_tp2 run exports (``convert_hf.py export``) as a
    directory of the same type whose logits are our model's with the checkpoint's weights and no capacity
    (transformers drops no choice; the run trained with one). Biases and norms are drawn (transformers starts
    them at 0 and 1: values a layout could not get wrong)."""
    import shutil

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    theirs_cfg, ours_cfg = EXPERTS[kind]
    torch.manual_seed(3)
    hf = tmp_path / "hf"
    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(
        **DIMS, **theirs_cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(mean=0.0 if name.endswith(".bias") else 1.0, std=0.2)
    model.save_pretrained(hf)
    shutil.copyfile(single_mixtral[0] / "tokenizer.json", hf / "tokenizer.json")  # the corpus's token ids
    tuned = [*MIXTRAL, f"trainer.init_from={hf}", *ours_cfg]
    alone = train_pooled([*tuned, "parallel=single"], tmp_path / "single", sbp_cache)
    split = train_pooled([*tuned, "parallel=dp2_tp2"], tmp_path / "split", sbp_cache)
    assert abs(alone[0] - single_mixtral[1][0]) > 0.1, alone
    assert_same_losses(split, alone)
    theirs, a, b = exported(tmp_path / "split", tmp_path / "back", f"{kind}ForCausalLM", capacity_factor=0.0)
    # A Qwen model's dense intermediate_size is moot with experts in every layer (the export writes ours there).
    said = {k: v for k, v in theirs_cfg.items() if kind in ("Mixtral", "Olmoe") or k != "intermediate_size"}
    assert all(getattr(theirs.config, k) == v for k, v in said.items()), theirs.config
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts_per_tok=5"], "model.num_experts_per_tok=5: must be between 1 and model.num_local_experts=4"),
    (["parallel=dp8"], "model.num_local_experts=4: must divide by parallel.dp=8 (expert parallelism"),
    (["model.capacity_factor=-1"], "model.capacity_factor=-1.0, model.router_aux_loss_coef=0.01: both must be >= 0"),
    (["parallel=cp2"], "parallel.cp=2 with model.num_local_experts=4"),
    (["model.shared_expert_intermediate_size=80", "parallel=tp3"],
     "model.shared_expert_intermediate_size=80: must divide by parallel.tp=3 (shared expert columns per rank)"),
    (["model.num_local_experts=0", "model.shared_expert_intermediate_size=80"],
     "model.shared_expert_intermediate_size=80: must be >= 0, and 0 without routed experts"),
])
def test_what_the_experts_cannot_do_is_refused_before_any_process_starts(overrides, message, tmp_path):
    assert message in refusal([*MIXTRAL, *overrides], tmp_path)
