"""Hugging Face Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMoE and OLMo 2 directories as
``trainer.init_from`` of the LLaMA recipe, and back.

Our model (``model.py``) has Hugging Face's parameter names, shapes and
rotary convention (rotate-half), so its weights load by name, unchanged,
each rank reading only the boxes of them it keeps (``ShardReader``), and
a checkpoint's ``model`` state is a Hugging Face state dict
(``scripts/convert_hf.py export`` writes it with ``hf_config``). Mixtral's
files keep each expert's ``w1``/``w3``/``w2`` (gate, up, down) apart under
``block_sparse_moe`` (so do ``transformers`` 5's ``save_pretrained`` and the
hub's): a box of our stacked experts reads its experts' regions and stacks
them, and export splits them back (``to_hf_files``). Qwen2-MoE's files keep
them apart too, under ``mlp.experts.{j}.{gate,up,down}_proj``; its
``num_experts`` and ``moe_intermediate_size`` are our
``num_local_experts`` and ``intermediate_size`` (every layer sparse: its
dense ``intermediate_size`` is unused); Qwen3-MoE's and OLMoE's files are
the same (OLMoE's ``intermediate_size`` is the experts'). Qwen3's query and
key norms are ``qk_norm``, its ``head_dim`` ours; OLMoE's are ``qk_norm``
over the whole projection (``qk_norm_over="projection"``), and so are OLMo
2's, whose layers are ``post_norm`` ones (the same parameter names, with
``post_feedforward_layernorm`` in place of ``input_layernorm``).
Rotary scaling of Llama 3.1's kind (``rope_scaling`` of type ``llama3``)
maps to the model's ``rope_*`` keys; an LM head tied to the embedding (as
Llama 3.2 1B/3B have it, with no ``lm_head.weight`` in their files) to
``tie_word_embeddings``; Qwen2's query, key and value biases to
``qkv_bias``; Mistral's and Mixtral's ``sliding_window`` (shorter than the
context) to ours. What our model does not implement is refused by name, before
any process starts: other rotary scaling, other biases, Qwen's windows (per
layer), attention dropout, another activation, router
jitter, Qwen2-MoE's and Qwen3-MoE's dense layers, OLMoE's ``clip_qkv`` and heads other than
``hidden_size`` wide in all (its query norm's width); a head size is otherwise a dimension like the others. A run
exports as a Llama directory (a Mistral one with a window), a Qwen2 one with
``qkv_bias``, a Mixtral one with experts, a Qwen2-MoE one
with experts and a shared expert, or with ``qk_norm`` a Qwen3 one (Qwen3-MoE with experts; OLMoE with experts
and norms over the projections; OLMo 2 with those norms and ``post_norm``).
"""
from __future__ import annotations

import json
import os

import torch

from recipes.hf_files import HFFiles, weight_files

# Our model config keys that must equal a config.json's (the rope_* scaling ones read from its rope_scaling).
DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_factor",
        "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
        "tie_word_embeddings", "qkv_bias", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
        "shared_expert_intermediate_size", "head_dim", "qk_norm", "qk_norm_over", "post_norm", "sliding_window")
# Options of ours that a config.json states by default (``hf_config`` writes them; a missing one is False).
FLAGS = ("tie_word_embeddings", "qkv_bias", "qk_norm", "post_norm")
# The experts' keys: a config.json of a dense model type has none (and then the routing ones are moot).
EXPERT_KEYS = ("num_local_experts", "num_experts_per_tok", "norm_topk_prob", "shared_expert_intermediate_size")
ROUTING_KEYS = ("num_experts_per_tok", "norm_topk_prob")
# Model types with experts -> their config.json's names of our keys, where they differ.
QWEN_EXPERT_NAMES = {"num_local_experts": "num_experts", "intermediate_size": "moe_intermediate_size"}
EXPERT_NAMES = {"mixtral": {}, "qwen2_moe": QWEN_EXPERT_NAMES, "qwen3_moe": QWEN_EXPERT_NAMES,
                "olmoe": {"num_local_experts": "num_experts"}}
# Our stacked experts -> the per-expert linear weights Mixtral's files hold under ``block_sparse_moe`` (``w1``
# gate, ``w3`` up, ``w2`` down); the other model types' files keep our names, under ``mlp``.
MIXTRAL_FILES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Model types whose config.json may say num_experts or (transformers 5's save_pretrained) num_local_experts.
EXPERTS_ALIASED = ("qwen3_moe", "olmoe")
QWEN3 = ("qwen3", "qwen3_moe")  # query and key norms, attention_bias (all four projections' biases) refused
OLMO = ("olmoe", "olmo2")  # query and key norms over the whole projections, attention_bias refused
# Our keys a LLaMA run's checkpoint may lack (recorded before they existed), and which hf_config writes its own way.
OPTIONAL = ("head_dim", "qk_norm_over", "sliding_window")
# Ours -> Hugging Face's key inside rope_scaling (rope_type "llama3"); a config without one has a factor of 1.
ROPE_SCALING = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor",
                "rope_original_max_position_embeddings": "original_max_position_embeddings"}


# transformers' defaults of each model type that loads, for keys a config.json leaves out.
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0, "tie_word_embeddings": False}
HF_DEFAULTS = {
    "llama": LLAMA_DEFAULTS,
    "mistral": {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "mixtral": {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "shared_expert_intermediate_size": 0},
    "qwen2_moe": {**LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 1408,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "max_position_embeddings": 32768,
                  "num_local_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 5632, "qkv_bias": True, "num_key_value_heads": 16},
    "qwen3": {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
              "head_dim": 128, "num_key_value_heads": 32},
    "qwen3_moe": {**LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 768,
                  "num_hidden_layers": 24, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "num_local_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 0},
    "olmo2": {**LLAMA_DEFAULTS, "vocab_size": 50304, "rms_norm_eps": 1e-5},
    "olmoe": {**LLAMA_DEFAULTS, "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
              "num_hidden_layers": 16, "num_attention_heads": 16, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "num_local_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
              "shared_expert_intermediate_size": 0},
}


def _scaling(hf: dict) -> dict:
    """A config.json's rotary scaling (``rope_scaling``, or transformers 5's ``rope_parameters`` less the theta);
    empty for none."""
    scaling = hf.get("rope_scaling") or {
        k: v for k, v in (hf.get("rope_parameters") or {}).items() if k != "rope_theta"}
    return {} if scaling.get("rope_type", scaling.get("type", "default")) == "default" else scaling


def _hf_value(hf: dict, key: str):
    if key in ROPE_SCALING:  # without Llama 3.1's scaling: a factor of 1, the rest as ours are by default
        scaling = _scaling(hf)
        if not scaling:
            return 1.0 if key == "rope_factor" else None
        return scaling.get(ROPE_SCALING[key])
    if key == "num_key_value_heads":
        return hf.get(key) or HF_DEFAULTS.get(hf.get("model_type"), {}).get(key) or _hf_value(hf, "num_attention_heads")
    kind = hf.get("model_type")
    if key == "qk_norm":
        return kind in (*QWEN3, *OLMO)
    if key == "qk_norm_over":
        return "projection" if kind in OLMO else "head"
    if key == "post_norm":
        return kind == "olmo2"
    if key == "sliding_window":  # Mistral's and Mixtral's; one as long as the context is none (ours: 0)
        window = hf.get(key, HF_DEFAULTS.get(kind, {}).get(key)) if kind in ("mistral", "mixtral") else None
        return 0 if window is None or window >= _hf_value(hf, "max_position_embeddings") else window
    if key == "head_dim":
        return hf.get(key) or HF_DEFAULTS.get(kind, {}).get(key) or _hf_value(hf, "hidden_size") // (
            _hf_value(hf, "num_attention_heads") or 1)
    if key == "qkv_bias":  # Qwen2's attention always has them, Qwen2-MoE's by default; Llama's, Mistral's and
        return kind == "qwen2" or (kind == "qwen2_moe" and bool(hf.get(key, True)))  # Mixtral's none (else refused)
    if key in EXPERT_KEYS and kind not in EXPERT_NAMES:  # a dense MLP
        return 0 if key in ("num_local_experts", "shared_expert_intermediate_size") else None
    defaults = HF_DEFAULTS.get(kind, LLAMA_DEFAULTS)
    if (kind == "mixtral" and key in ("norm_topk_prob", "shared_expert_intermediate_size")) or (
            kind in ("qwen3_moe", "olmoe") and key == "shared_expert_intermediate_size"):
        return defaults[key]  # transformers' Mixtral always renormalises; only Qwen2-MoE has a shared expert
    if key == "rope_theta":  # transformers 5 keeps it under rope_parameters, which wins over a top-level copy
        return (hf.get("rope_parameters") or {}).get("rope_theta", hf.get(key, defaults[key]))
    if key == "num_local_experts" and kind in EXPERTS_ALIASED:  # the hub's files say num_experts, transformers 5's
        return hf.get("num_experts", hf.get(key, defaults[key]))  # save_pretrained may write its alias
    return hf.get(EXPERT_NAMES.get(kind, {}).get(key, key), defaults.get(key))


def unsupported(hf: dict) -> list:
    """The options of a Hugging Face Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMoE or OLMo 2
    ``config.json`` that our model does not implement."""
    bad = []
    kind = hf.get("model_type")
    if kind not in HF_DEFAULTS:
        bad.append(f"model_type={kind!r} (these load: {', '.join(HF_DEFAULTS)})")
    scaling = _scaling(hf)
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        bad.append(f"rope_scaling={scaling} (ours: plain rotary embeddings, or Llama 3.1's 'llama3' scaling)")
    for key in ("attention_bias", "mlp_bias"):
        if kind in ("llama", *QWEN3, *OLMO) and hf.get(key):
            bad.append(f"{key}=true (ours has no biases beyond Qwen2's on the query, key and value)")
    windowed = hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())
    if kind in ("qwen2", "qwen2_moe", *QWEN3) and windowed:
        bad.append("use_sliding_window=true, or sliding_attention layers (ours: one window for every layer, "
                   "Mistral's and Mixtral's sliding_window)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names of one function
        bad.append(f"hidden_act={hf.get('hidden_act')!r} (ours: SwiGLU with SiLU)")
    if kind == "mixtral" and hf.get("router_jitter_noise"):
        bad.append(f"router_jitter_noise={hf.get('router_jitter_noise')} (ours routes the hidden states as they are)")
    if kind in ("qwen2_moe", "qwen3_moe") and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        bad.append(f"decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, mlp_only_layers="
                   f"{hf.get('mlp_only_layers')} (ours: experts in every layer; valid: 1 and [])")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        bad.append(f"clip_qkv={hf.get('clip_qkv')} (ours does not clamp the queries, keys and values)")
    heads = _hf_value(hf, "num_attention_heads") or 1
    if kind == "olmoe" and _hf_value(hf, "head_dim") * heads != _hf_value(hf, "hidden_size"):
        bad.append(f"head_dim={_hf_value(hf, 'head_dim')} with {heads} heads (OLMoE's query norm is hidden_size wide: "
                   "heads x head_dim must be hidden_size)")
    if kind in ("qwen2_moe", "qwen3_moe", "olmoe") and not _hf_value(hf, "num_local_experts"):
        bad.append(f"{kind} with no experts (ours: {kind}'s experts in every layer)")
    if hf.get("attention_dropout"):
        bad.append(f"attention_dropout={hf.get('attention_dropout')} (ours has no attention dropout)")
    return bad


def hf_dir_problems(path: str, model_cfg) -> list:
    """What ``trainer.init_from`` would refuse in the Hugging Face directory ``path`` for ``model_cfg``, from its
    ``config.json`` and file names alone (no weights read)."""
    cpath = os.path.join(path, "config.json")
    try:
        with open(cpath) as f:
            hf = json.load(f)
    except ValueError as err:  # json.JSONDecodeError
        return [f"{cpath}: not valid JSON ({err})"]
    problems = [f"its config.json has {b}" for b in unsupported(hf)]
    scaled = bool(_scaling(hf)) or model_cfg.rope_factor != 1.0  # without scaling its other keys do not count
    experts = model_cfg.get("num_local_experts", 0) or _hf_value(hf, "num_local_experts")
    normed = model_cfg.get("qk_norm", False) or _hf_value(hf, "qk_norm")  # else where the norms go is moot
    wrong = [k for k in DIMS if (scaled or k not in ROPE_SCALING or k == "rope_factor")
             and (experts or k not in ROUTING_KEYS) and (normed or k != "qk_norm_over")
             and _hf_value(hf, k) != _ours(model_cfg, k)]
    if wrong:
        problems.append(f"its config.json has {', '.join(f'{k}={_hf_value(hf, k)}' for k in wrong)}, the model "
                        f"{', '.join(f'{k}={_ours(model_cfg, k)}' for k in wrong)}; valid: the model settings that "
                        "match it (model.hidden_size=..., or a preset)")
    try:
        files, index = weight_files(path)
    except (OSError, ValueError, KeyError) as err:
        return problems + [str(err)]
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if absent:
        problems.append(f"{index} names {absent[:3]}, which are not in {path}")
    return problems


def _ours(model_cfg, key: str):
    """Our model config's value of ``key``, as ``_hf_value`` gives a config.json's (a head size of 0 resolved)."""
    if key == "head_dim":
        return model_cfg.get(key, 0) or model_cfg.hidden_size // (model_cfg.num_attention_heads or 1)
    if key == "qk_norm_over":
        return model_cfg.get(key, "head")
    if key == "sliding_window":  # as long as the context: none
        window = model_cfg.get(key, 0)
        return 0 if window >= model_cfg.max_position_embeddings else window
    return type(model_cfg.get(key, 0))(model_cfg.get(key, 0))


def file_names(name: str, experts: int, kind: str = "mixtral") -> list:
    """The Hugging Face files' tensors our parameter ``name`` is made of: itself; with ``experts``, in the files
    of model type ``kind``, the router under its experts' module (Mixtral's ``block_sparse_moe``), and one per
    expert (in expert order) for a stacked expert tensor."""
    layer, found, proj = name.partition(".mlp.experts.")
    mixtral = kind == "mixtral"
    if found:
        module, piece = ("block_sparse_moe", MIXTRAL_FILES[proj]) if mixtral else ("mlp", proj)
        return [f"{layer}.{module}.experts.{j}.{piece}.weight" for j in range(experts)]
    if experts and mixtral and name.endswith(".mlp.gate.weight"):
        return [name.replace(".mlp.gate.", ".block_sparse_moe.gate.")]
    return [name]


class ShardReader:
    """``read(name, box)``: the box ``((start, length), ...)`` of parameter ``name`` from a Hugging Face Llama,
    Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMoE or OLMo 2 directory, in the parameter's dtype: the
    ``init_shard`` that ``read_weights_from`` gives a model (``recipes.hf_files``). An LM head tied to the
    embedding reads the embedding's rows, as transformers ties them, even where the files keep a copy under the
    head's name (a last stage reading that copy could start from other values than the first stage's
    embedding).
    """

    def __init__(self, path: str, model, model_cfg):
        problems = hf_dir_problems(path, model_cfg)
        if problems:
            raise ValueError(f"trainer.init_from={path}: " + "; ".join(problems))
        self.files, self.model = HFFiles(path), model
        self.tied = bool(model_cfg.get("tie_word_embeddings", False))
        self.experts = int(model_cfg.get("num_local_experts", 0))
        with open(os.path.join(path, "config.json")) as f:
            self.kind = json.load(f).get("model_type")
        missing = [n for n, _ in model.named_parameters() if any(s not in self.files.names for s in self._stored(n))]
        if missing:
            raise ValueError(f"trainer.init_from={path}: no weights for {missing[:5]}")
        wrong = [f"{s} is {list(self.files.shape(s))} there, {list(self._piece_shape(n, p))} here"
                 for n, p in model.named_parameters() for s in self._stored(n)
                 if self.files.shape(s) != self._piece_shape(n, p)]
        if wrong:
            raise ValueError(f"trainer.init_from={path}: other shapes than the model's: " + "; ".join(wrong[:3]))

    def _stored(self, name: str) -> list:
        """The files' tensors parameter ``name`` is made of (``file_names``; the embedding for a tied LM head)."""
        if name == "lm_head.weight" and self.tied:
            return ["model.embed_tokens.weight"]
        return file_names(name, self.experts, self.kind)

    def _piece_shape(self, name: str, param) -> tuple:
        return tuple(param.shape[1:] if ".mlp.experts." in name else param.shape)

    def read(self, name: str, box) -> torch.Tensor:
        region = tuple(slice(start, start + n) for start, n in box)
        dtype, stored = self.model.get_parameter(name).dtype, self._stored(name)
        if ".mlp.experts." not in name:
            return self.files.read(stored[0], region, dtype).contiguous()
        if region[0].stop <= region[0].start:
            return torch.empty(tuple(n for _, n in box), dtype=dtype)
        return torch.stack([self.files.read(stored[j], region[1:], dtype) for j in range(region[0].start,
                                                                                          region[0].stop)])


def read_weights_from(model, path: str, model_cfg) -> None:
    """Make ``model`` (the whole model or a pipeline stage of it, its parameters on the meta device, the full
    model's names) build each parameter's shard from the Hugging Face directory ``path``: its ``init_shard`` is
    a ``ShardReader``'s ``read``, which ``distribute_module`` calls with each box this rank keeps (the trainer
    removes it once the parameters are laid out, and the reader and its open files go with it). Every name is checked against the files
    here, before any is read."""
    model.init_shard = ShardReader(path, model, model_cfg).read


def holds_llama(model_state: dict) -> bool:
    """Whether a checkpoint's ``model`` state is this recipe's model (by its embedding's name)."""
    return "model.embed_tokens.weight" in model_state


BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")


def hf_config(ours: dict, tokenizer=None) -> dict:
    """A Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMoE or
    OLMo 2, by what the model has) for our model config (``recipes.llama.model.LlamaConfig``'s
    fields, as a checkpoint's ``extra.model_config`` records them). ``tokenizer``: the run's ``TextTokenizer``,
    whose end-of-text (and beginning-of-text) ids the config names, so that ``generate`` stops where the
    corpus's documents end; without one they are ``None`` (transformers' own defaults, 1 and 2, are ordinary
    tokens of a tokenizer trained on the corpus)."""
    missing = [k for k in DIMS if k not in ours and k not in (*ROPE_SCALING, *FLAGS, *EXPERT_KEYS, *OPTIONAL)]
    if missing:
        raise ValueError(f"the checkpoint's extra.model_config lacks {missing}: not a LLaMA run's checkpoint")
    experts = int(ours.get("num_local_experts", 0))
    shared = int(ours.get("shared_expert_intermediate_size", 0))
    qwen3 = bool(ours.get("qk_norm", False))
    if qwen3 and (shared or ours.get("qkv_bias", False)):
        raise ValueError("the checkpoint's model has query/key norms and a shared expert or query/key/value biases: no "
                         "Hugging Face model type has that (Qwen3: norms, no biases; Qwen2-MoE: a shared expert)")
    projection = qwen3 and ours.get("qk_norm_over", "head") == "projection"
    olmo2 = bool(ours.get("post_norm", False))
    if olmo2 and (not projection or experts):
        raise ValueError("the checkpoint's model has norms after the attention and the MLP but not query/key norms "
                         "over the whole projections, or has experts: no Hugging Face model type has that (OLMo 2: "
                         "those norms, a dense MLP)")
    olmoe = projection and not olmo2
    window = ours.get("sliding_window", 0)
    window = 0 if window >= ours["max_position_embeddings"] else window
    if window and (qwen3 or olmo2 or shared or ours.get("qkv_bias", False)
                   or (experts and not ours.get("norm_topk_prob", True))):
        raise ValueError(f"the checkpoint's model has a sliding window of {window} and query/key norms, "
                         "query/key/value biases, a shared expert or unnormalised routing weights: no Hugging Face "
                         "model type has that (Mistral and Mixtral: windows)")
    head_dim = ours.get("head_dim", 0) or ours["hidden_size"] // ours["num_attention_heads"]
    if olmoe and (not experts or head_dim * ours["num_attention_heads"] != ours["hidden_size"]):
        raise ValueError("the checkpoint's model has query/key norms over the whole projections but no experts, or "
                         "heads x head_dim other than hidden_size: no Hugging Face model type has that (OLMoE: "
                         "experts, heads x head_dim = hidden_size)")
    qwen2_moe = experts and not qwen3 and (
        shared or ours.get("qkv_bias", False) or not ours.get("norm_topk_prob", True))
    if qwen2_moe and not shared:
        raise ValueError("the checkpoint's model has experts, no shared expert, and query/key/value biases or "
                         "unnormalised routing weights: no Hugging Face model type has that (Mixtral: experts with "
                         "normalised weights; Qwen2-MoE: experts beside a shared expert)")
    bos = None if tokenizer is None else next(
        (i for i in map(tokenizer.tokenizer.token_to_id, BOS_CANDIDATES) if i is not None), None)
    scaling = None if ours.get("rope_factor", 1.0) == 1.0 else {
        "rope_type": "llama3", **{theirs: ours[k] for k, theirs in ROPE_SCALING.items()}}
    qwen2 = bool(ours.get("qkv_bias", False))  # Qwen2's decoder; else Llama's (a Mistral without a window is one)
    kind = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
            "sliding_window": None} if qwen2 else {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "attention_bias": False, "mlp_bias": False}
    if window:
        kind = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": window}
    routing = {"num_experts_per_tok": ours.get("num_experts_per_tok"), "output_router_logits": False,
               "router_aux_loss_coef": ours.get("router_aux_loss_coef", 0.001)}
    if olmo2:
        kind = {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "attention_bias": False}
    elif olmoe:  # OLMoE's intermediate_size is its experts'
        kind = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], **routing, "num_experts": experts,
                "norm_topk_prob": bool(ours.get("norm_topk_prob", True)), "clip_qkv": None, "attention_bias": False}
    elif qwen3:  # Qwen3-MoE's dense layers' intermediate_size is moot (every layer has experts): ours, a placeholder
        kind = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None}
        if experts:
            kind = {**kind, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **routing,
                    "num_experts": experts, "moe_intermediate_size": ours["intermediate_size"],
                    "norm_topk_prob": bool(ours.get("norm_topk_prob", True)), "decoder_sparse_step": 1,
                    "mlp_only_layers": []}
    elif qwen2_moe:  # its dense layers' intermediate_size is moot (every layer has experts): ours, as a placeholder
        kind = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **routing,
                "num_experts": experts, "moe_intermediate_size": ours["intermediate_size"],
                "shared_expert_intermediate_size": shared, "norm_topk_prob": bool(ours.get("norm_topk_prob", True)),
                "qkv_bias": qwen2, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                "sliding_window": None}
    elif experts:
        kind = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "sliding_window": window or None,
                "num_local_experts": experts, **routing, "router_jitter_noise": 0.0}
    dims = [k for k in DIMS if k not in (*ROPE_SCALING, *FLAGS, *EXPERT_KEYS, *OPTIONAL)]
    return {**{k: ours[k] for k in dims}, **kind,
            "rope_scaling": scaling, "initializer_range": ours.get("initializer_range", 0.02), "hidden_act": "silu",
            "tie_word_embeddings": bool(ours.get("tie_word_embeddings", False)), "attention_dropout": 0.0,
            "head_dim": head_dim,
            "dtype": "float32", "bos_token_id": bos, "pad_token_id": None,
            "eos_token_id": None if tokenizer is None else tokenizer.eos_id}


def to_hf_files(state: dict, config: dict) -> dict:
    """A LLaMA run's ``model`` state as the tensors of a Hugging Face directory whose ``config.json`` is
    ``config`` (``hf_config``'s): the same, but with experts in the files' form of its model type (Mixtral's:
    each layer's router under ``block_sparse_moe``, each expert's ``w1``/``w3``/``w2`` a tensor of its own;
    Qwen2-MoE's: each expert's projections apart under ``mlp.experts.{j}``; what ``ShardReader`` reads back).
    With experts it empties ``state`` as it goes, so that a stacked tensor is freed once its pieces are copied
    out (safetensors refuses views that share storage): the export holds about one copy of the weights, not
    two."""
    kind = config["model_type"]
    if kind not in EXPERT_NAMES:
        return dict(state)
    experts = _hf_value(config, "num_local_experts")
    out = {}
    for name in list(state):
        value = state.pop(name)
        if ".mlp.experts." in name:
            out.update({piece: value[j].clone() for j, piece in enumerate(file_names(name, experts, kind))})
        else:
            out[file_names(name, experts, kind)[0]] = value
    return out
