"""Hugging Face Llama, Mistral, Qwen2 and Mixtral directories as ``trainer.init_from`` of the LLaMA recipe, and back.

Our model (``model.py``) has Hugging Face's parameter names, shapes and
rotary convention (rotate-half), so its weights load by name, unchanged,
each rank reading only the boxes of them it keeps (``ShardReader``), and
a checkpoint's ``model`` state is a Hugging Face state dict
(``scripts/convert_hf.py export`` writes it with ``hf_config``). Mixtral's
files keep each expert's ``w1``/``w3``/``w2`` (gate, up, down) apart under
``block_sparse_moe`` (so do ``transformers`` 5's ``save_pretrained`` and the
hub's): a box of our stacked experts reads its experts' regions and stacks
them, and export splits them back (``to_hf_files``).
Rotary scaling of Llama 3.1's kind (``rope_scaling`` of type ``llama3``)
maps to the model's ``rope_*`` keys; an LM head tied to the embedding (as
Llama 3.2 1B/3B have it, with no ``lm_head.weight`` in their files) to
``tie_word_embeddings``; Qwen2's query, key and value biases to
``qkv_bias``. What our model does not implement is refused by name, before
any process starts: other rotary scaling, other biases, a sliding window
shorter than the context, attention dropout, another activation or head
size, router jitter. A run exports as a Llama directory, a Qwen2 one with ``qkv_bias``, or a Mixtral one
with experts.
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
        "tie_word_embeddings", "qkv_bias", "num_local_experts", "num_experts_per_tok")
# Options of ours that a config.json states by default (``hf_config`` writes them; a missing one is False).
FLAGS = ("tie_word_embeddings", "qkv_bias")
# Mixtral's keys: a config.json of another model type has no experts (and then ``num_experts_per_tok`` is moot).
EXPERT_KEYS = ("num_local_experts", "num_experts_per_tok")
# Our stacked experts -> the per-expert linear weights Mixtral's files hold (``w1`` gate, ``w3`` up, ``w2`` down).
EXPERT_FILES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
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
                "num_local_experts": 8, "num_experts_per_tok": 2},
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
    if key == "qkv_bias":  # Qwen2's attention always has them; Llama's, Mistral's and Mixtral's none (else refused)
        return hf.get("model_type") == "qwen2"
    if key in EXPERT_KEYS and hf.get("model_type") != "mixtral":  # a dense MLP
        return 0 if key == "num_local_experts" else None
    defaults = HF_DEFAULTS.get(hf.get("model_type"), LLAMA_DEFAULTS)
    if key == "rope_theta":  # transformers 5 keeps it under rope_parameters, which wins over a top-level copy
        return (hf.get("rope_parameters") or {}).get("rope_theta", hf.get(key, defaults[key]))
    return hf.get(key, defaults.get(key))


def unsupported(hf: dict) -> list:
    """The options of a Hugging Face Llama, Mistral, Qwen2 or Mixtral ``config.json`` that our model does not
    implement."""
    bad = []
    kind = hf.get("model_type")
    if kind not in HF_DEFAULTS:
        bad.append(f"model_type={kind!r} (these load: {', '.join(HF_DEFAULTS)})")
    scaling = _scaling(hf)
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        bad.append(f"rope_scaling={scaling} (ours: plain rotary embeddings, or Llama 3.1's 'llama3' scaling)")
    for key in ("attention_bias", "mlp_bias"):
        if kind == "llama" and hf.get(key):
            bad.append(f"{key}=true (ours has no biases beyond Qwen2's on the query, key and value)")
    window = _hf_value(hf, "sliding_window")
    if kind == "qwen2" and (hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())):
        bad.append("use_sliding_window=true, or sliding_attention layers (ours attends to every earlier position)")
    if kind in ("mistral", "mixtral") and window is not None and window < _hf_value(hf, "max_position_embeddings"):
        bad.append(f"sliding_window={window} (ours attends to every earlier position: a window shorter than "
                   "max_position_embeddings would differ)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names of one function
        bad.append(f"hidden_act={hf.get('hidden_act')!r} (ours: SwiGLU with SiLU)")
    if kind == "mixtral" and hf.get("router_jitter_noise"):
        bad.append(f"router_jitter_noise={hf.get('router_jitter_noise')} (ours routes the hidden states as they are)")
    if hf.get("attention_dropout"):
        bad.append(f"attention_dropout={hf.get('attention_dropout')} (ours has no attention dropout)")
    heads, hidden = _hf_value(hf, "num_attention_heads") or 1, _hf_value(hf, "hidden_size") or 0
    if hf.get("head_dim") not in (None, hidden // heads):
        bad.append(f"head_dim={hf.get('head_dim')} (ours: hidden_size / num_attention_heads = {hidden // heads})")
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
    wrong = [k for k in DIMS if (scaled or k not in ROPE_SCALING or k == "rope_factor")
             and (experts or k != "num_experts_per_tok")
             and _hf_value(hf, k) != type(model_cfg.get(k, 0))(model_cfg.get(k, 0))]
    if wrong:
        problems.append(f"its config.json has {', '.join(f'{k}={_hf_value(hf, k)}' for k in wrong)}, the model "
                        f"{', '.join(f'{k}={model_cfg[k]}' for k in wrong)}; valid: the model settings that match "
                        "it (model.hidden_size=..., or a preset)")
    try:
        files, index = weight_files(path)
    except (OSError, ValueError, KeyError) as err:
        return problems + [str(err)]
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if absent:
        problems.append(f"{index} names {absent[:3]}, which are not in {path}")
    return problems


def file_names(name: str, experts: int) -> list:
    """The Hugging Face files' tensors our parameter ``name`` is made of: itself; with ``experts``, the router
    under Mixtral's ``block_sparse_moe``, and one per expert (in expert order) for a stacked expert tensor."""
    layer, found, kind = name.partition(".mlp.experts.")
    if found:
        return [f"{layer}.block_sparse_moe.experts.{j}.{EXPERT_FILES[kind]}.weight" for j in range(experts)]
    if experts and name.endswith(".mlp.gate.weight"):
        return [name.replace(".mlp.gate.", ".block_sparse_moe.gate.")]
    return [name]


class ShardReader:
    """``read(name, box)``: the box ``((start, length), ...)`` of parameter ``name`` from a Hugging Face Llama,
    Mistral, Qwen2 or Mixtral directory, in the parameter's dtype: the ``init_shard`` that ``read_weights_from`` gives a
    model (``recipes.hf_files``). An LM head tied to the embedding reads the embedding's rows, as transformers
    ties them, even where the files keep a copy under the head's name (a last stage reading that copy could
    start from other values than the first stage's embedding).
    """

    def __init__(self, path: str, model, model_cfg):
        problems = hf_dir_problems(path, model_cfg)
        if problems:
            raise ValueError(f"trainer.init_from={path}: " + "; ".join(problems))
        self.files, self.model = HFFiles(path), model
        self.tied = bool(model_cfg.get("tie_word_embeddings", False))
        self.experts = int(model_cfg.get("num_local_experts", 0))
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
        return file_names(name, self.experts)

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
    """A Hugging Face Llama ``config.json`` dict for our model config (``recipes.llama.model.LlamaConfig``'s
    fields, as a checkpoint's ``extra.model_config`` records them). ``tokenizer``: the run's ``TextTokenizer``,
    whose end-of-text (and beginning-of-text) ids the config names, so that ``generate`` stops where the
    corpus's documents end; without one they are ``None`` (transformers' own defaults, 1 and 2, are ordinary
    tokens of a tokenizer trained on the corpus)."""
    missing = [k for k in DIMS if k not in ours and k not in ROPE_SCALING and k not in FLAGS and k not in EXPERT_KEYS]
    experts = int(ours.get("num_local_experts", 0))
    if experts and ours.get("qkv_bias", False):
        raise ValueError("the checkpoint's model has experts and query/key/value biases: no Hugging Face model type "
                         "has both (Mixtral: experts; Qwen2: biases)")
    if missing:
        raise ValueError(f"the checkpoint's extra.model_config lacks {missing}: not a LLaMA run's checkpoint")
    bos = None if tokenizer is None else next(
        (i for i in map(tokenizer.tokenizer.token_to_id, BOS_CANDIDATES) if i is not None), None)
    scaling = None if ours.get("rope_factor", 1.0) == 1.0 else {
        "rope_type": "llama3", **{theirs: ours[k] for k, theirs in ROPE_SCALING.items()}}
    qwen2 = bool(ours.get("qkv_bias", False))  # Qwen2's decoder; else Llama's (a Mistral without a window is one)
    kind = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
            "sliding_window": None} if qwen2 else {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "attention_bias": False, "mlp_bias": False}
    if experts:
        kind = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "sliding_window": None,
                "num_local_experts": experts, "num_experts_per_tok": ours["num_experts_per_tok"],
                "router_aux_loss_coef": ours.get("router_aux_loss_coef", 0.001), "router_jitter_noise": 0.0,
                "output_router_logits": False}
    dims = [k for k in DIMS if k not in ROPE_SCALING and k not in FLAGS and k not in EXPERT_KEYS]
    return {**{k: ours[k] for k in dims}, **kind,
            "rope_scaling": scaling, "initializer_range": ours.get("initializer_range", 0.02), "hidden_act": "silu",
            "tie_word_embeddings": bool(ours.get("tie_word_embeddings", False)), "attention_dropout": 0.0,
            "head_dim": ours["hidden_size"] // ours["num_attention_heads"],
            "dtype": "float32", "bos_token_id": bos, "pad_token_id": None,
            "eos_token_id": None if tokenizer is None else tokenizer.eos_id}


def to_hf_files(state: dict, experts: int) -> dict:
    """A LLaMA run's ``model`` state as a Hugging Face directory's tensors: the same, but with experts in
    Mixtral's files' form (each layer's router under ``block_sparse_moe``, each expert's ``w1``/``w3``/``w2``
    a tensor of its own; what ``ShardReader`` reads back). With experts it empties ``state`` as it goes, so
    that a stacked tensor is freed once its pieces are copied out (safetensors refuses views that share
    storage): the export holds about one copy of the weights, not two."""
    if not experts:
        return dict(state)
    out = {}
    for name in list(state):
        value = state.pop(name)
        if ".mlp.experts." in name:
            out.update({piece: value[j].clone() for j, piece in enumerate(file_names(name, experts))})
        else:
            out[file_names(name, experts)[0]] = value
    return out
