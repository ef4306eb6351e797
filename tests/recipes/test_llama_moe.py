"""Mixtral's and Qwen2-MoE's sparse MLP in the LLaMA recipe: Hugging Face's outputs without drops, GShard's drops at
a capacity, expert parallelism as all-to-alls, the shared expert split on tp, and the checks that refuse what it
does not do.

Layouts against one device: ``tests/runtime/test_pipeline_schedules.py``
(losses, gradients and parameters, float64) and ``tests/cli/test_mixtral_cli.py``
(``train.py``'s jobs).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from benchkit.experts import as_transformers
from recipes.llama.model import LlamaConfig, LlamaForCausalLM
from recipes.llama.moe import SparseMoE, capacity
from sbp_core.sbp import Broadcast, Split
from toolkit.rank_pool import get_pool

CFG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
                  router_aux_loss_coef=0.0)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_without_drops_logits_and_gradients_match_transformers_mixtral():
    """No capacity (every choice kept): Hugging Face's Mixtral (its eager experts) with our weights gives our logits
    and, through the loss, our gradients. Its router computes in float32 (ours in float64 here), hence 1e-6."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = LlamaForCausalLM(CFG).double()
    theirs = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        rms_norm_eps=CFG.rms_norm_eps, rope_theta=CFG.rope_theta, sliding_window=None,
        attn_implementation="eager", experts_implementation="eager")).double()
    _assert_matches_transformers(ours, theirs, 1e-6)


def _assert_matches_transformers(ours, theirs, grad_bar: float) -> dict:
    """``theirs`` (a ``transformers`` model) with ``ours``' weights gives our logits within 1e-6 and, through the
    next-token loss, every gradient within ``grad_bar``; returns our gradients by their names."""
    theirs.load_state_dict(as_transformers(ours.state_dict()), strict=True)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = ours(ids, ids)
    out = theirs(ids, labels=ids)
    assert _rel(logits, out.logits) < 1e-6
    loss.backward()
    F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()
    grads = as_transformers({n: p.grad for n, p in ours.named_parameters()})
    for name, p in theirs.named_parameters():
        assert _rel(grads[name], p.grad) < grad_bar, name
    return grads


# Qwen2-MoE's differences from Mixtral: a gated shared expert, unnormalised routing weights, query/key/value biases.
QWEN2_MOE = replace(CFG, shared_expert_intermediate_size=40, norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6)
# OLMoE's: norms over the whole query and key projections, unnormalised routing weights.
OLMOE_KEYS = {"qk_norm": True, "qk_norm_over": "projection", "norm_topk_prob": False}


def test_without_drops_logits_and_gradients_match_transformers_qwen2_moe():
    """As for Mixtral: Hugging Face's Qwen2-MoE with our weights (biases drawn, not transformers' zeros) gives our
    logits and gradients, the shared expert's included (the project's 1e-5 for gradients: its router's float32
    weights, no longer renormalised, carry their rounding into every gradient)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = LlamaForCausalLM(QWEN2_MOE).double()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(std=0.3)
    theirs = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=48,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_theta=CFG.rope_theta, attn_implementation="eager", experts_implementation="eager")).double()
    grads = _assert_matches_transformers(ours, theirs, 1e-5)  # their float32 weights, unnormalised: 1.6e-6 here
    assert any("shared_expert" in n for n in grads)


def test_without_drops_logits_and_gradients_match_transformers_olmoe():
    """OLMoE: an RMSNorm over the whole query projection and one over the whole key projection (their weights
    drawn), unnormalised routing weights. Its norms compute in float32 (ours in float64 here): 1e-5."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = LlamaForCausalLM(replace(CFG, **OLMOE_KEYS)).double()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    theirs = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        rms_norm_eps=CFG.rms_norm_eps, rope_theta=CFG.rope_theta, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager", experts_implementation="eager")).double()
    grads = _assert_matches_transformers(ours, theirs, 1e-5)
    assert grads["model.layers.0.self_attn.q_norm.weight"].shape == (32,)  # the projection's width, not a head's


def _by_loop(moe: SparseMoE, x: torch.Tensor):
    """The sparse MLP, one choice at a time: per sample, token by token, each token's choices most probable first,
    each taking a slot of its expert while one is free; a choice finding none adds nothing. And each sample's
    balance: E * sum over experts of (its choices there per token) * (its tokens' mean probability there)."""
    cfg = moe.config
    b, t, h = x.shape
    slots = capacity(cfg, t)
    probs = torch.softmax(moe.gate(x), -1)
    w, chosen = probs.topk(cfg.num_experts_per_tok, -1)
    w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    y = torch.zeros_like(x)
    balance = torch.zeros(b, dtype=x.dtype)
    dropped = 0
    for s in range(b):
        for e in range(cfg.num_local_experts):
            share = (chosen[s] == e).sum() / t
            balance[s] += cfg.num_local_experts * share * probs[s, :, e].mean()
        taken = [0] * cfg.num_local_experts
        for i in range(t):
            for j in range(cfg.num_experts_per_tok):
                e = int(chosen[s, i, j])
                if taken[e] == slots:
                    dropped += 1
                    continue
                taken[e] += 1
                v = x[s, i]
                out = (F.silu(ex.gate_proj[e] @ v) * (ex.up_proj[e] @ v)) @ ex.down_proj[e].T
                y[s, i] += w[s, i, j] * out
    return y, balance, dropped


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0])
def test_a_capacity_drops_the_choices_a_loop_over_the_queues_drops(factor):
    torch.manual_seed(0)
    moe = SparseMoE(replace(CFG, capacity_factor=factor)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 16, 32, dtype=torch.float64)
    y, balance = moe(x)
    want, want_balance, dropped = _by_loop(moe, x)
    assert _rel(y, want) < 1e-12 and _rel(balance, want_balance) < 1e-12
    assert (dropped > 0) == (factor > 0), dropped  # 0.5 and 1.0 leave a full expert somewhere in this batch


def test_what_a_position_keeps_does_not_depend_on_later_tokens():
    """At a capacity that drops choices, changing the sample's last tokens leaves every earlier position's output
    as it was: the drops of a causal model's position are decided by the tokens before it."""
    torch.manual_seed(0)
    moe = SparseMoE(replace(CFG, capacity_factor=0.5)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 16, 32, dtype=torch.float64)
    later = x.clone()
    later[:, 12:] = torch.randn(3, 4, 32, dtype=torch.float64)
    assert _by_loop(moe, x)[2] > 0
    assert torch.equal(moe(x)[0][:, :12], moe(later)[0][:, :12])


def test_one_sample_and_one_layer_balance_is_transformers_load_balancing_loss():
    """Hugging Face pools every token and layer into one product; for one sample and one layer it is ours."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    moe = SparseMoE(CFG).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    theirs = load_balancing_loss_func((moe.gate(x)[0],), CFG.num_local_experts, CFG.num_experts_per_tok)
    assert _rel(moe(x)[1], theirs.double()) < 1e-6  # their softmax in float32


def _expert_parallel_traffic():
    """Rank side: one forward and backward of a float64 sparse MLP with its experts split over two ranks (dp2, the
    plan's EXPERTS); the collectives it ran, and its output and gradients whole."""
    import sbp_core as sc
    from recipes.llama.plan import EXPERTS
    from toolkit.mesh import plan_for_module

    torch.manual_seed(0)
    moe = SparseMoE(replace(CFG, capacity_factor=1.0)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    placement = sc.placement("cpu", [[0], [1]])
    plan = {k.replace("*.mlp.", ""): v for k, v in EXPERTS.items()}
    names = tuple(n for n, _ in moe.named_parameters()) + tuple(n for n, _ in moe.named_modules())
    sc.distribute_module(moe, placement, plan_for_module(moe, plan, names))
    x = torch.randn(4, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xg = sc.to_global(x.tensor_split(2)[torch.distributed.get_rank()], placement=placement,
                      sbp=(Split(0), sc.sbp.broadcast)).requires_grad_()
    from sbp_core.dispatch import explain

    with sc.comm_ledger() as ledger, explain() as steps:
        y, balance = moe(xg)
        (y.sum() + balance.sum()).backward()
    ops = [(r.op, r.bytes) for r in ledger.records]
    # Buffers made in forward and by autograd in backward: each rank's own samples, never every rank's.
    made = [(op, str(outs[0])) for op, _, _, outs, _ in steps if "zeros" in op or "empty" in op]
    assert made and all(outs == "(S(0), B)" for _, outs in made), made
    grads = {n: p.grad.full_tensor() for n, p in moe.named_parameters()}
    return ops, y.full_tensor(), {**grads, "x": xg.grad.full_tensor()}, {n: tuple(p.sbp) for n, p in moe.named_parameters()}


def test_expert_parallelism_moves_tokens_by_all_to_all_and_keeps_expert_gradients_split():
    """Over two ranks, each holding two of the four experts: forward boxes the dispatched buffer to the experts and
    back (two all-to-alls), backward its gradient the same two ways; the experts' weights are never gathered, and
    only the replicated router's gradient is reduced. Routing runs on each rank's own samples (nothing of it is
    gathered). Values: one device's."""
    res = get_pool(2).run(_expert_parallel_traffic)
    ops, y, grads, sbps = res[0]
    assert [op for op, _ in ops].count("all_to_all") == 4, ops
    assert {op for op, _ in ops} == {"all_to_all", "all_reduce"}, ops
    b, c, h = 4, capacity(replace(CFG, capacity_factor=1.0), 16), 32
    buffer = CFG.num_local_experts * b * c * h * 8  # the [E, b, c, h] float64 buffer, whole
    assert all(n == buffer // 4 for op, n in ops if op == "all_to_all"), ops  # half of a half stays home
    reduced = [n for op, n in ops if op == "all_reduce"]
    assert reduced == [CFG.num_local_experts * h * 8 * 2 * (2 - 1) // 2], ops  # ring: 2(p-1)/p of the router
    assert sbps["experts.gate_proj"][0] == Split(0) and sbps["gate.weight"][0].is_broadcast
    _assert_one_devices(CFG, y, grads)


def _assert_one_devices(cfg, y, grads):
    """``y`` and ``grads`` (by parameter name, and ``"x"``) are one device's: the float64 sparse MLP of ``cfg`` at
    capacity 1.0, seeded and drawn as the rank sides draw it, forward and backward on the same input."""
    torch.manual_seed(0)
    ref = SparseMoE(replace(cfg, capacity_factor=1.0)).double()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(4, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    want, balance = ref(x)
    (want.sum() + balance.sum()).backward()
    assert _rel(y, want) < 1e-12
    for n, p in [*ref.named_parameters(), ("x", x)]:
        assert _rel(grads[n], p.grad) < 1e-12, n


def _shared_expert_on_tp():
    """Rank side: one forward and backward of a float64 Qwen2-MoE sparse MLP on tp2 (the plan's EXPERTS and
    SHARED_EXPERT); its output's SBP, the shared expert's local shapes, the collectives, output and gradients."""
    import sbp_core as sc
    from recipes.llama.plan import EXPERTS, SHARED_EXPERT
    from toolkit.mesh import plan_for_module

    torch.manual_seed(0)
    moe = SparseMoE(replace(QWEN2_MOE, capacity_factor=1.0)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    placement = sc.placement("cpu", [[0, 1]])
    plan = {k.replace("*.mlp.", ""): v for k, v in {**EXPERTS, **SHARED_EXPERT}.items()}
    names = tuple(n for n, _ in moe.named_parameters()) + tuple(n for n, _ in moe.named_modules())
    sc.distribute_module(moe, placement, plan_for_module(moe, plan, names))
    x = torch.randn(4, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xg = sc.to_global(x, placement=placement, sbp=(Split(0), sc.sbp.broadcast)).requires_grad_()
    with sc.comm_ledger() as ledger:
        y, balance = moe(xg)
    sbp = str(y.sbp)
    (y.sum() + balance.sum()).backward()
    shapes = {n: tuple(p.to_local().shape) for n, p in moe.named_parameters() if "shared" in n}
    grads = {n: p.grad.full_tensor() for n, p in moe.named_parameters()}
    return sbp, shapes, [r.op for r in ledger.records], y.full_tensor(), {**grads, "x": xg.grad.full_tensor()}


def test_the_shared_expert_is_split_on_tp_and_summed_with_the_routed_experts_before_any_reduction():
    """tp2: the shared expert's gate and up projections are column-split, its down projection row-split, so its
    output is partial as the routed experts' is; the layer returns their sum still partial (the residual add reduces
    it once) and its forward runs no collective. Values and gradients: one device's."""
    sbp, shapes, ops, y, grads = get_pool(2).run(_shared_expert_on_tp)[0]
    assert sbp == "(B, P(sum))" and ops == [], (sbp, ops)  # dp is one rank here: its axis reads B
    assert shapes == {"shared_expert.gate_proj.weight": (20, 32), "shared_expert.up_proj.weight": (20, 32),
                      "shared_expert.down_proj.weight": (32, 20), "shared_expert_gate.weight": (1, 32)}, shapes
    _assert_one_devices(QWEN2_MOE, y, grads)


def test_the_load_balancing_loss_joins_the_training_loss_and_not_evaluation():
    """With autograd recording, the loss is the next-token loss plus the weight times the mean balance per layer
    (about k = 2 each at initialisation); under no_grad, as evaluation runs, the next-token loss alone."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(replace(CFG, router_aux_loss_coef=0.5)).double()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = model(ids, ids)
    plain = F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    with torch.no_grad():
        assert torch.equal(model(ids, ids)[1], plain.detach())
    assert 0.5 * 1.5 < loss.item() - plain.item() < 0.5 * 2.5


def test_a_tensor_parallel_override_of_an_expert_keeps_it_split_over_dp():
    from recipes.llama.plan import mesh_plan
    from toolkit.mesh import with_overrides

    plan = with_overrides(mesh_plan(experts=True), {"model.layers.0.mlp.experts.up_proj": "B",
                                                    "model.layers.0.self_attn.q_proj.weight": "B"})
    assert plan["model.layers.0.mlp.experts.up_proj"] == (Split(0), Broadcast())
    assert plan["model.layers.0.self_attn.q_proj.weight"] == (Broadcast(), Broadcast())


def _experts_dir(path, kind="mixtral", **changes):
    """A tiny ``transformers`` Mixtral (or Qwen2-MoE: ``kind``) saved as Hugging Face saves it (each expert's
    projections apart: Mixtral's w1, w3, w2)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    dims = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
            "num_experts_per_tok": 2, "rms_norm_eps": CFG.rms_norm_eps, "rope_theta": CFG.rope_theta,
            "experts_implementation": "eager"}
    qwen = {"intermediate_size": 64, "moe_intermediate_size": 48, "num_experts": 4}
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**dims, "num_local_experts": 4,
                                                                              **changes}))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{
            **dims, **qwen, "shared_expert_intermediate_size": 40, "norm_topk_prob": False, **changes}))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
            **dims, **qwen, "head_dim": 16, "norm_topk_prob": True, **changes}))
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{
            **dims, "num_experts": 4, "norm_topk_prob": False, "eos_token_id": None, "pad_token_id": None,
            **changes}))
    model.save_pretrained(path)
    return model


def _experts_model_cfg(**changes):
    from omegaconf import OmegaConf

    from recipes.llama.config import ModelConfig

    dims = {k: getattr(CFG, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                         "num_local_experts", "num_experts_per_tok", "rms_norm_eps")}
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {**dims, **changes})


QWEN2_MOE_KEYS = {"shared_expert_intermediate_size": 40, "norm_topk_prob": False, "qkv_bias": True}
KEYS = {"mixtral": {}, "qwen2_moe": QWEN2_MOE_KEYS, "qwen3_moe": {"head_dim": 16, "qk_norm": True}, "olmoe": OLMOE_KEYS}


@pytest.mark.parametrize("kind", list(KEYS))
def test_an_experts_directory_loads_box_by_box_and_exports_back(kind, tmp_path):
    """A box of our stacked experts reads its experts' regions of the per-expert files; the whole model then gives
    transformers' logits; ``to_hf_files`` writes the files' names and tensors back. Mixtral's, Qwen2-MoE's,
    Qwen3-MoE's (query and key norms, heads of 16 on a width of 32) and OLMoE's (norms over the projections)."""
    from recipes.llama import hf

    theirs = _experts_dir(tmp_path, kind)
    keys = KEYS[kind]
    ours = LlamaForCausalLM(replace(CFG, **keys))
    reader = hf.ShardReader(str(tmp_path), ours, _experts_model_cfg(**keys))
    box = reader.read("model.layers.1.mlp.experts.down_proj", ((1, 2), (8, 16), (0, 48)))
    want = torch.stack([theirs.model.layers[1].mlp.experts.down_proj[j, 8:24] for j in (1, 2)])
    assert torch.equal(box, want.detach())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(reader.read(name, tuple((0, n) for n in p.shape)))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(ours(ids)[0], theirs(input_ids=ids).logits) < 1e-5
    from safetensors.torch import load_file

    files = load_file(str(tmp_path / "model.safetensors"))
    config = hf.hf_config({**vars(replace(CFG, **keys))})
    assert config["model_type"] == kind
    back = hf.to_hf_files(ours.state_dict(), config)
    assert set(back) == set(files) and all(torch.equal(back[k], files[k]) for k in files)


def test_a_mixtral_directory_with_a_sliding_window_loads_and_exports_with_it(tmp_path):
    """A Mixtral directory whose ``sliding_window`` (8) is shorter than the sequence (16) gives transformers'
    logits in a model with that window, and not without it; ``hf_config`` writes the window back."""
    from recipes.llama import hf

    theirs = _experts_dir(tmp_path, "mixtral", sliding_window=8)
    ours = LlamaForCausalLM(replace(CFG, sliding_window=8))
    reader = hf.ShardReader(str(tmp_path), ours, _experts_model_cfg(sliding_window=8))
    unwindowed = LlamaForCausalLM(replace(CFG))
    with torch.no_grad():
        for model in (ours, unwindowed):
            for name, p in model.named_parameters():
                p.copy_(reader.read(name, tuple((0, n) for n in p.shape)))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
        assert _rel(ours(ids)[0], want) < 1e-5 and _rel(unwindowed(ids)[0], want) > 1e-3
    config = hf.hf_config({**vars(replace(CFG, sliding_window=8))})
    assert (config["model_type"], config["sliding_window"]) == ("mixtral", 8)


@pytest.mark.parametrize("changes, model, message", [
    ({"router_jitter_noise": 0.1}, {}, "router_jitter_noise=0.1 (ours routes the hidden states as they are)"),
    ({"sliding_window": 16}, {}, "sliding_window=16, the model sliding_window=0"),
    ({}, {"num_experts_per_tok": 1}, "num_experts_per_tok=2, the model num_experts_per_tok=1"),
    ({}, {"num_local_experts": 0}, "num_local_experts=4, the model num_local_experts=0"),
    ({"kind": "qwen2_moe", "decoder_sparse_step": 2}, QWEN2_MOE_KEYS,
     "decoder_sparse_step=2, mlp_only_layers=[] (ours: experts in every layer"),
    ({"kind": "qwen3_moe", "mlp_only_layers": [1]}, KEYS["qwen3_moe"],
     "decoder_sparse_step=1, mlp_only_layers=[1] (ours: experts in every layer"),
    ({"kind": "olmoe", "clip_qkv": 8.0}, OLMOE_KEYS, "clip_qkv=8.0 (ours does not clamp"),
    ({"kind": "olmoe", "head_dim": 16}, OLMOE_KEYS, "head_dim=16 with 4 heads (OLMoE's query norm is hidden_size"),
    ({"kind": "olmoe"}, {**OLMOE_KEYS, "qk_norm_over": "head"},
     "qk_norm_over=projection, the model qk_norm_over=head"),
    ({"kind": "qwen2_moe"}, {**QWEN2_MOE_KEYS, "norm_topk_prob": True, "shared_expert_intermediate_size": 0},
     "norm_topk_prob=False, shared_expert_intermediate_size=40, the model norm_topk_prob=True, "
     "shared_expert_intermediate_size=0"),
])
def test_what_an_experts_directory_has_and_the_model_lacks_is_refused(changes, model, message, tmp_path):
    from recipes.llama import hf

    _experts_dir(tmp_path, **changes)
    assert any(message in p for p in hf.hf_dir_problems(str(tmp_path), _experts_model_cfg(**model))), \
        hf.hf_dir_problems(str(tmp_path), _experts_model_cfg(**model))
