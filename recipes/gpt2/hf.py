"""GPT-2 weights between Hugging Face ``transformers`` and our layout (names, shapes, ``c_attn`` order).

Our GPT-2 (``recipes/gpt2/model.py``) has HF's parameter names and shapes,
with one difference of order: ``c_attn``'s ``3 * n_embd`` output columns are
grouped per head, ``[q_h k_h v_h]`` for each head ``h``, where HF has
``[all q | all k | all v]`` (so that a column split gives each tensor
parallel rank whole heads). Conversion permutes those columns of the weight
and the entries of the bias; nothing else changes. Pure tensor code: the
model class is not needed.

Config: our fields are ``GPT2Config``'s (``recipes/gpt2/model.py``); HF's
GPT-2 config has the same names, less ``make_vocab_size_divisible_by``:
a padded vocabulary gets zero rows on import (their logits are masked to
``-inf``, so the values are HF's) and loses them on export. HF options our model does not
implement (another activation, cross attention, layer-index attention
scaling, ``n_inner != 4 * n_embd``) are refused by name.
"""
from __future__ import annotations

import json
import os
from dataclasses import fields

import torch

from recipes.hf_files import HFFiles, weight_files

from .model import GPT2Config, padded_vocab_size

# Hugging Face's GPT-2 config uses the same names; it has no vocabulary padding (Megatron's option).
CONFIG_KEYS = tuple(f.name for f in fields(GPT2Config) if f.name != "make_vocab_size_divisible_by")
TIED = ("transformer.wte.weight", "lm_head.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks some HF versions store; not weights


def qkv_permutation(n_embd: int, n_head: int) -> torch.Tensor:
    """``perm`` with ``ours[..., c] == hf[..., perm[c]]`` for ``c_attn``'s output columns."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
    return torch.arange(3 * n_embd).view(3, n_head, n_embd // n_head).transpose(0, 1).reshape(-1)


def config_from_hf(hf: dict) -> dict:
    """Our config fields from a HF ``config.json`` dict; raises for options our model lacks."""
    bad = unsupported(hf)
    if bad:
        raise ValueError("this GPT-2 config uses options our model does not implement: " + "; ".join(bad))
    missing = [k for k in CONFIG_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    return {k: hf[k] for k in CONFIG_KEYS}


def unsupported(hf: dict) -> list:
    """The options of a HF GPT-2 ``config.json`` that our model does not implement, one line each."""
    if hf.get("model_type", "gpt2") != "gpt2":
        return [f"model_type={hf.get('model_type')!r} (only GPT-2, 'gpt2', converts)"]
    act = hf.get("activation_function", "gelu_new")
    options = {
        "activation_function": (act not in ("gelu_new", "gelu_pytorch_tanh"), act,
                                "our MLP uses the tanh GELU ('gelu_new')"),
        "n_inner": (hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 768)), hf.get("n_inner"), "ours is 4 * n_embd"),
        "add_cross_attention": (bool(hf.get("add_cross_attention")), True, "ours has none"),
        "scale_attn_by_inverse_layer_idx": (bool(hf.get("scale_attn_by_inverse_layer_idx")), True,
                                            "ours scales by 1/sqrt(head size) only"),
        "scale_attn_weights": (not hf.get("scale_attn_weights", True), False, "ours scales attention"),
        "tie_word_embeddings": (not hf.get("tie_word_embeddings", True), False, "ours ties the LM head to wte"),
    }
    return [f"{k}={v!r} ({why})" for k, (is_bad, v, why) in options.items() if is_bad]


def hf_config(ours: dict, base: dict | None = None) -> dict:
    """A HF GPT-2 ``config.json`` dict for our config (``base``: a HF config to keep other fields from)."""
    out = dict(base or {})
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        out.pop(k, None)
    out.update({k: ours[k] for k in CONFIG_KEYS})
    out.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
               n_inner=None, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               add_cross_attention=False, reorder_and_upcast_attn=out.get("reorder_and_upcast_attn", False))
    out.setdefault("tie_word_embeddings", True)
    for key in ("bos_token_id", "eos_token_id"):  # GPT-2's 50256 only exists in its own vocabulary
        v = out.get(key, 50256)
        out[key] = v if isinstance(v, int) and v < ours["vocab_size"] else None
    return out


def from_hf(hf_sd: dict, cfg: dict) -> dict:
    """Our model state (plain tensors, ``lm_head.weight`` the same tensor as ``wte`` when tied) from HF's."""
    out = {}
    for name, t in hf_sd.items():
        if name.endswith(_BUFFERS):
            continue
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        out[name] = t
    perm = qkv_permutation(cfg["n_embd"], cfg["n_head"])
    for name in list(out):
        if name.endswith(".attn.c_attn.weight"):
            out[name] = out[name][:, perm].contiguous()
        elif name.endswith(".attn.c_attn.bias"):
            out[name] = out[name][perm].contiguous()
    if "lm_head.weight" not in out or torch.equal(out["lm_head.weight"], out[TIED[0]]):
        out["lm_head.weight"] = out[TIED[0]]
    _check_names(out, cfg)
    return with_vocab_rows(out, padded_vocab_size(cfg["vocab_size"], cfg.get("make_vocab_size_divisible_by", 1)))


def with_vocab_rows(sd: dict, rows: int) -> dict:
    """``sd`` with the embedding and the LM head cut or zero-padded to ``rows`` rows (tied ones stay one tensor)."""
    out = dict(sd)
    for name in TIED:
        t = sd[name]
        if name == TIED[1] and t is sd[TIED[0]]:
            out[name] = out[TIED[0]]
        elif t.shape[0] != rows:
            out[name] = t[:rows] if t.shape[0] > rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    return out


def to_hf(ours: dict, cfg: dict) -> tuple:
    """``(HF state dict, tied)``: HF names and ``c_attn`` order, ``cfg["vocab_size"]`` rows (a padded
    vocabulary's extra rows dropped); ``lm_head.weight`` left out when tied."""
    _check_names(ours, cfg)
    rows = ours[TIED[0]].shape[0]
    if rows < cfg["vocab_size"]:
        raise ValueError(f"the embedding has {rows} rows, fewer than vocab_size={cfg['vocab_size']}")
    ours = with_vocab_rows(ours, cfg["vocab_size"])
    inv = torch.argsort(qkv_permutation(cfg["n_embd"], cfg["n_head"]))
    out = {}
    for name, t in ours.items():
        if name.endswith(".attn.c_attn.weight"):
            t = t[:, inv]
        elif name.endswith(".attn.c_attn.bias"):
            t = t[inv]
        out[name] = t.contiguous()
    tied = torch.equal(out["lm_head.weight"], out[TIED[0]])
    if tied:
        del out["lm_head.weight"]
    return out, tied


def expected_names(cfg: dict) -> list:
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(cfg["n_layer"]):
        for mod in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{mod}.weight", f"transformer.h.{i}.{mod}.bias"]
    return names + ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]


def _check_names(sd: dict, cfg: dict) -> None:
    want = set(expected_names(cfg))
    missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or extra:
        raise ValueError(f"GPT-2 weights do not match the config ({cfg['n_layer']} layers): "
                         f"missing {missing[:6]}, unexpected {extra[:6]}")


# -- Hugging Face directories -------------------------------------------------

def hf_dir_problems(path: str, model_cfg) -> list:
    """What ``trainer.init_from`` would refuse in the Hugging Face directory ``path`` for ``model_cfg``, read
    from its ``config.json`` and file names alone (no weights read)."""
    cpath = os.path.join(path, "config.json")
    try:
        with open(cpath) as f:
            hf = json.load(f)
    except ValueError as err:  # json.JSONDecodeError
        return [f"{cpath}: not valid JSON ({err})"]
    try:
        files, index = weight_files(path)
    except (OSError, ValueError, KeyError) as err:
        return [str(err)]
    problems = [f"its config.json has {b}" for b in unsupported(hf)]
    wrong = [k for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
             if hf.get(k) != int(model_cfg[k])]
    if wrong:
        problems.append(f"its config.json has {', '.join(f'{k}={hf.get(k)}' for k in wrong)}, the model "
                        f"{', '.join(f'{k}={model_cfg[k]}' for k in wrong)}; valid: the model settings that match "
                        "it (model.n_layer, model.n_embd, ...; for a published GPT-2, model=<its name>)")
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if absent:
        problems.append(f"{index} names {absent[:3]}, which are not in {path}")
    return problems


def read_hf_dir(path: str) -> tuple:
    """``(config dict, state dict)`` of a ``transformers`` model directory (safetensors or ``.bin``, sharded or
    not)."""
    cpath = os.path.join(path, "config.json")
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{cpath}: missing; a Hugging Face model directory holds config.json")
    with open(cpath) as f:
        config = json.load(f)
    files, _ = weight_files(path)
    sd = {}
    for name in files:
        fpath = os.path.join(path, name)
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd.update(load_file(fpath))
        else:  # weights only: a .bin cannot run code while it loads
            sd.update(torch.load(fpath, map_location="cpu", weights_only=True))
    return config, sd


def write_hf_dir(path: str, config: dict, hf_sd: dict) -> None:
    """``config.json`` + ``model.safetensors`` that ``GPT2LMHeadModel.from_pretrained`` loads."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in hf_sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def hub_dir(name: str) -> str | None:
    """The directory of Hugging Face hub model ``name`` in this machine's hub cache (``HF_HOME``,
    ``HF_HUB_CACHE``), or ``None`` when it is not there: nothing is downloaded (jobs run offline; fetch
    it once with ``huggingface-cli download <name>``)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repo id
        return None
    return path if is_hf_dir(path) else None


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "manifest.json"))


class ShardReader:
    """``read(name, box)``: the box ``((start, length), ...)`` of our parameter ``name`` from a Hugging Face
    GPT-2 directory, in the parameter's dtype: the ``init_shard`` that ``read_weights_from`` gives a model
    (``recipes.hf_files``). Our layout from HF's: ``c_attn``'s columns (and bias entries) in per-head order
    (a box's columns are HF's in runs, its heads' q, k and v, each run read apart), a padded vocabulary's
    rows past HF's zero, the LM head the embedding (ours is tied), names with or without HF's
    ``transformer.``. Every tensor's shape is checked against the model's before any is read.
    """

    def __init__(self, path: str, model, model_cfg):
        problems = hf_dir_problems(path, model_cfg)
        if problems:
            raise ValueError(f"trainer.init_from={path}: " + "; ".join(problems))
        self.files, self.model = HFFiles(path), model
        self.vocab = int(model_cfg.vocab_size)
        self.perm = qkv_permutation(int(model_cfg.n_embd), int(model_cfg.n_head))
        missing = [n for n, _ in model.named_parameters() if self._stored(n) is None]
        if missing:
            raise ValueError(f"trainer.init_from={path}: no weights for {missing[:5]}")
        wrong = [f"{n} is {list(self.files.shape(self._stored(n)))} there, {list(p.shape)} here"
                 for n, p in model.named_parameters() if self.files.shape(self._stored(n)) != self._file_shape(n, p)]
        if wrong:
            raise ValueError(f"trainer.init_from={path}: other shapes than the model's: " + "; ".join(wrong[:3]))

    def _file_shape(self, name: str, param) -> tuple:
        """The shape the file's tensor must have: the parameter's, the vocabulary's rows unpadded."""
        return (self.vocab, *param.shape[1:]) if name in TIED else tuple(param.shape)

    def _stored(self, name: str) -> str | None:
        name = TIED[0] if name == TIED[1] else name
        bare = name.removeprefix("transformer.")  # older files name the blocks without the prefix
        return next((n for n in (name, bare) if n in self.files.names), None)

    def read(self, name: str, box) -> torch.Tensor:
        stored, dtype = self._stored(name), self.model.get_parameter(name).dtype
        region = [slice(start, start + n) for start, n in box]
        if name.endswith((".attn.c_attn.weight", ".attn.c_attn.bias")):  # HF's columns of ours, in our order
            cols = self.perm[region[-1]].tolist()
            runs = [i for i in range(len(cols)) if i == 0 or cols[i] != cols[i - 1] + 1] + [len(cols)]
            parts = [self.files.read(stored, (*region[:-1], slice(cols[a], cols[b - 1] + 1)), dtype)
                     for a, b in zip(runs, runs[1:])]
            part = torch.cat(parts, dim=-1) if parts else self.files.read(stored, tuple(region), dtype)
        elif name in TIED:  # rows past HF's vocabulary: padding, zero
            rows = region[0]
            part = self.files.read(stored, (slice(rows.start, max(rows.start, min(rows.stop, self.vocab))),
                                            *region[1:]), dtype)
            part = torch.cat([part, part.new_zeros(rows.stop - rows.start - len(part), *part.shape[1:])])
        else:
            part = self.files.read(stored, tuple(region), dtype)
        return part.contiguous()


def read_weights_from(model, path: str, model_cfg) -> None:
    """Make ``model`` (the whole model or a pipeline stage of it, its parameters on the meta device, the full
    model's names) build each parameter's shard from the Hugging Face directory ``path`` as
    ``distribute_module`` asks for it: its ``init_shard`` is a ``ShardReader``'s ``read``. Every name is checked
    against the files here, before any is read."""
    model.init_shard = ShardReader(path, model, model_cfg).read