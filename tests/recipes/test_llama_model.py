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

transformers = pytest.importorskip("transformers")

DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=24, rms_norm_eps=1e-5, rope_theta=500000.0)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query attention
def test_logits_loss_and_gradients_match_transformers(kv_heads):
    torch.manual_seed(0)
    ours = LlamaForCausalLM(LlamaConfig(**DIMS, num_key_value_heads=kv_heads))
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **DIMS, num_key_value_heads=kv_heads, tie_word_embeddings=False, attn_implementation="eager"))
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
