"""GPT-2 between Hugging Face ``transformers`` directories and our checkpoints; LLaMA runs to Hugging Face.

    python scripts/convert_hf.py import <hf_dir> <ckpt_dir> [--make-vocab-size-divisible-by N]
    python scripts/convert_hf.py export <run_or_ckpt_dir> <hf_dir> [--n-head N]

``import`` reads a ``transformers`` GPT-2 directory (``config.json`` and
``model.safetensors`` or ``pytorch_model.bin``, sharded or not) and writes
``<ckpt_dir>/step_0`` (+ ``latest``) holding ``model`` (our names, ``c_attn``
columns per head, the vocabulary's rows zero-padded to a multiple of
``--make-vocab-size-divisible-by``, 128 by default as in the ``gpt2*``
presets) and ``extra.model_config``, and copies the directory's
``tokenizer.json`` into ``<ckpt_dir>``; ``trainer.init_from=<ckpt_dir>``
(or ``toolkit.checkpoint.load(<ckpt_dir>, {"model": model.state_dict()})``)
loads it under any layout, and a GPT-2 job tokenizes with that tokenizer.

``export`` reads the newest checkpoint of a run directory, a checkpoint root
or a checkpoint directory (saved under any layout and world size) and writes
``config.json`` + ``model.safetensors`` that
``GPT2LMHeadModel.from_pretrained`` loads. The model config comes from the
checkpoint's ``extra.model_config`` (or ``extra.hf_config``), else from the
run's ``config.yaml``, else from the weights' shapes plus ``--n-head``;
rows of the embedding past the recorded ``vocab_size`` (padding) are
dropped.
A LLaMA run's checkpoint (``recipe=llama``) exports as a ``LlamaForCausalLM``
directory (``MistralForCausalLM`` with a sliding window,
``Qwen2ForCausalLM`` with query/key/value biases, ``Qwen3ForCausalLM`` with
query/key norms, ``Olmo2ForCausalLM`` with norms over the projections and
after each block): its tensors already have
Hugging Face's names and shapes, and its ``extra.model_config`` gives
``config.json`` (a LLaMA needs no ``import``: ``trainer.init_from`` reads a
Hugging Face directory itself). A run with experts exports as a
``MixtralForCausalLM`` directory (``Qwen2MoeForCausalLM`` with a shared
expert, ``Qwen3MoeForCausalLM`` with query/key norms, ``OlmoeForCausalLM``
with norms over the projections), each stacked expert
tensor split into per-expert tensors (``recipes.llama.hf.to_hf_files``).
When the run directory above the checkpoint holds the run's tokenizer
(``tokenizer.json``, which a GPT-2 run copies there), export copies it
beside the weights: a ``tokenizers`` file that
``PreTrainedTokenizerFast(tokenizer_file=...)`` and
``AutoTokenizer.from_pretrained(<hf_dir>)`` load.

One process, no process group; nothing is unpickled (safetensors,
``torch.load(weights_only=True)``, JSON).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


from toolkit import checkpoint as ckpt
from recipes.gpt2 import hf as hf_gpt2
from recipes.llama import hf as hf_llama
from recipes.gpt2.data.tokenizer import TOKENIZER_FILE, load_tokenizer, tokenizer_of_weights
from toolkit.checkpoint.directory import resolve
from toolkit.checkpoint.errors import CheckpointError


def import_hf(hf_dir: str, ckpt_dir: str, vocab_multiple: int = 128) -> str:
    """Write ``hf_dir``'s GPT-2 as checkpoint ``<ckpt_dir>/step_0``, its vocabulary padded to a multiple of
    ``vocab_multiple`` rows (``model.make_vocab_size_divisible_by``, 128 in the ``gpt2*`` presets); returns
    its path."""
    if vocab_multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by {vocab_multiple}: must be >= 1")
    hf_cfg, hf_sd = hf_gpt2.read_hf_dir(hf_dir)
    cfg = {**hf_gpt2.config_from_hf(hf_cfg), "make_vocab_size_divisible_by": vocab_multiple}
    model = hf_gpt2.from_hf(hf_sd, cfg)
    state = {"model": model, "step": 0,
             "extra": {"model_config": cfg, "hf_config": hf_cfg, "source": os.path.abspath(hf_dir)}}
    path = ckpt.save(ckpt_dir, 0, state, tied=[hf_gpt2.TIED])
    tokenizer, beside = os.path.join(hf_dir, TOKENIZER_FILE), os.path.join(ckpt_dir, TOKENIZER_FILE)
    if os.path.isfile(tokenizer):  # beside the checkpoints, where trainer.init_from=<ckpt_dir> finds it
        shutil.copyfile(tokenizer, beside)
    elif os.path.isfile(beside):  # an earlier import's: not these weights'
        os.remove(beside)
    return path


def find_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory, a checkpoint root or a checkpoint directory."""
    for cand in (path, os.path.join(path, "checkpoints"), os.path.join(path, "ckpt")):
        try:
            return resolve(cand)
        except CheckpointError:
            continue
    raise CheckpointError(f"{os.path.abspath(path)}: no checkpoint here or in its checkpoints/ subdirectory")


def _run_config(ckpt_path: str) -> dict:
    """The ``model`` section of the run's ``config.yaml`` above the checkpoint, if any."""
    d = ckpt_path
    for _ in range(4):
        d = os.path.dirname(d)
        cpath = os.path.join(d, "config.yaml")
        if os.path.isfile(cpath):
            import yaml

            with open(cpath) as f:
                doc = yaml.safe_load(f) or {}
            return doc.get("model") or {}
    return {}


def model_config(model: dict, extra: dict, ckpt_path: str, n_head: int | None) -> dict:
    """Our GPT-2 config for exported weights (see the module docstring for where it comes from)."""
    extra = extra or {}
    if isinstance(extra.get("model_config"), dict):
        cfg = dict(extra["model_config"])
    elif isinstance(extra.get("hf_config"), dict):
        cfg = hf_gpt2.config_from_hf(extra["hf_config"])
    else:
        run = _run_config(ckpt_path)
        drop = run.get("dropout", 0.1)
        cfg = {"n_head": n_head or run.get("n_head"), "embd_pdrop": drop, "resid_pdrop": drop, "attn_pdrop": drop,
               "layer_norm_epsilon": run.get("layer_norm_epsilon", 1e-5),
               "initializer_range": run.get("initializer_range", 0.02), "vocab_size": run.get("vocab_size")}
    if n_head is not None:
        cfg["n_head"] = n_head
    if not cfg.get("n_head"):
        raise ValueError(f"{ckpt_path}: the number of heads is not recorded (no extra.model_config, no run "
                         "config.yaml); pass --n-head")
    rows, n_embd = model["transformer.wte.weight"].shape
    # The recorded vocabulary: the rows past it are padding (model.make_vocab_size_divisible_by), which export drops.
    vocab = int(cfg.get("vocab_size") or rows)
    if vocab > rows:
        raise ValueError(f"{ckpt_path}: the embedding has {rows} rows but the recorded vocab_size is {vocab}")
    cfg.update(vocab_size=vocab, n_embd=int(n_embd), n_positions=int(model["transformer.wpe.weight"].shape[0]),
               n_layer=len({k.split(".")[2] for k in model if k.startswith("transformer.h.")}))
    return {k: cfg[k] for k in hf_gpt2.CONFIG_KEYS}


def export_hf(src: str, hf_dir: str, n_head: int | None = None) -> str:
    """Write the newest checkpoint under ``src`` as a ``transformers`` GPT-2 or LLaMA-family directory, with the run's
    ``tokenizer.json`` when there is one (``tokenizer_of_weights``); returns ``hf_dir``."""
    path = find_checkpoint(src)
    state = ckpt.load(path, {"model": None, "extra": None})
    if not state.get("model"):
        raise CheckpointError(f"{path}: holds no 'model' state")
    if hf_llama.holds_llama(state["model"]):
        if n_head is not None:
            raise ValueError(f"--n-head {n_head}: a LLaMA checkpoint records its heads (extra.model_config)")
        tokenizer = tokenizer_of_weights(path)
        config = hf_llama.hf_config((state.get("extra") or {}).get("model_config") or {},
                                    load_tokenizer(tokenizer) if tokenizer else None)
        model = hf_llama.to_hf_files(state["model"], config)
        if config["tie_word_embeddings"]:  # one tensor, saved under the embedding's name (as Hugging Face does)
            model.pop("lm_head.weight", None)
        hf_gpt2.write_hf_dir(hf_dir, config, model)
    elif "transformer.wte.weight" in state["model"]:
        cfg = model_config(state["model"], state.get("extra"), path, n_head)
        hf_sd, tied = hf_gpt2.to_hf(state["model"], cfg)
        base = (state.get("extra") or {}).get("hf_config")
        config = hf_gpt2.hf_config(cfg, base if isinstance(base, dict) else None)
        config["tie_word_embeddings"] = tied
        hf_gpt2.write_hf_dir(hf_dir, config, hf_sd)
    else:
        raise ValueError(f"{path}: holds neither a GPT-2's nor a LLaMA's weights (no transformer.wte.weight or "
                         "model.embed_tokens.weight); export converts those two recipes' checkpoints")
    tokenizer = tokenizer_of_weights(path)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(hf_dir, TOKENIZER_FILE))
    return hf_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="Hugging Face GPT-2 directory -> our checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128, dest="vocab_multiple",
                     help="pad the vocabulary's rows to a multiple of this (the gpt2* presets' "
                          "model.make_vocab_size_divisible_by; 1: no padding)")
    exp = sub.add_parser("export", help="our GPT-2 or LLaMA checkpoint (run, root or step directory) -> Hugging "
                                        "Face directory, "
                                        "with the run's tokenizer.json when the run directory holds one")
    exp.add_argument("src")
    exp.add_argument("hf_dir")
    exp.add_argument("--n-head", type=int, default=None, help="a GPT-2's heads, when the checkpoint does not record "
                                                              "them")
    args = ap.parse_args(argv)
    if args.cmd == "import":
        path = import_hf(args.hf_dir, args.ckpt_dir, args.vocab_multiple)
        tokenizer = tokenizer_of_weights(path)
        print(f"imported {args.hf_dir} -> {path}" + (f" (with {tokenizer})" if tokenizer else
                                                      f" ({args.hf_dir} has no {TOKENIZER_FILE}: weights only)"))
    else:
        out = export_hf(args.src, args.hf_dir, args.n_head)
        path = find_checkpoint(args.src)
        tokenizer = tokenizer_of_weights(path)
        print(f"exported {path} -> {out}" + (f" (with {tokenizer})" if tokenizer else
                                              " (no tokenizer.json in the run directory: weights and config only)"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"convert_hf: error: {exc}", file=sys.stderr)
        sys.exit(2)
