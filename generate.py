"""Sample text from a trained run: ``python generate.py run=<run dir> [prompt=... tokens=200 temperature=0.8 top_k=50 seed=0]``.

Reads the run's ``config.yaml``, its newest checkpoint (any layout it was
trained in: the checkpoint reshards into one process) and its
``tokenizer.json``, and prints the prompt's continuation. Samples from the
language-model recipes' runs (``recipe=gpt2``, ``recipe=llama``). A ``run``
that is not a directory, has no ``config.yaml`` or ``tokenizer.json``, is
another recipe's run or has no checkpoint ends with a one-line error (exit
status 1) before any model is built.
"""
from __future__ import annotations

import os
import sys

import torch

# The language-model recipes, and the model key holding the longest context each can read.
CONTEXT = {"gpt2": "n_positions", "llama": "max_position_embeddings"}
OPTIONS = {"run": None, "prompt": "def ", "tokens": "200", "temperature": "0.8", "top_k": "50", "seed": "0"}


def parse(argv) -> dict:
    opts = dict(OPTIONS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in OPTIONS:
            raise SystemExit(f"generate.py: {arg!r}: expected key=value with key one of {', '.join(OPTIONS)}")
        opts[key] = value
    if not opts["run"]:
        raise SystemExit("generate.py: run=<run dir> is required (a directory train.py wrote)")
    return opts


def check_run(run: str):
    """The typed config of ``run``, a language-model run directory; a one-line ``SystemExit`` naming ``run``
    otherwise."""
    from toolkit.config import load_config

    if not os.path.isdir(run):
        raise SystemExit(f"generate.py: run={run}: no such directory (give a run directory train.py wrote)")
    if not os.path.isfile(os.path.join(run, "config.yaml")):
        raise SystemExit(f"generate.py: run={run}: no config.yaml there, so not a run directory train.py wrote")
    cfg = load_config(run)
    if cfg.recipe.name not in CONTEXT:
        raise SystemExit(f"generate.py: run={run} was trained with recipe={cfg.recipe.name}; generate.py samples "
                         f"from language-model runs only (recipe={' or '.join(CONTEXT)})")
    if not os.path.isfile(os.path.join(run, "tokenizer.json")):
        raise SystemExit(f"generate.py: run={run}: no tokenizer.json there (train.py copies the run's tokenizer "
                         "into its run directory when training starts)")
    return cfg


@torch.no_grad()
def sample(model, ids: list, n: int, temperature: float, top_k: int, context: int) -> list:
    out = list(ids)
    for _ in range(n):
        x = torch.tensor([out[-context:]])
        logits = model(x)[0][0, -1].float()
        if temperature <= 0:
            out.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        out.append(int(torch.multinomial(torch.softmax(logits, -1), 1)))
    return out


def main(argv=None) -> str:
    opts = parse(sys.argv[1:] if argv is None else argv)
    run = opts["run"]
    cfg = check_run(run)

    from recipes.registry import get
    from toolkit import checkpoint as ckpt
    from recipes.gpt2.data.tokenizer import load_tokenizer
    from toolkit.run_state import checkpoint_root

    path = ckpt.latest(checkpoint_root(run))
    if path is None:
        raise SystemExit(f"generate.py: {run} has no checkpoint yet (train.py saves one at the end)")
    recipe = get(cfg.recipe.name)
    model = recipe.build_model(cfg.model).eval()
    ckpt.load(path, {"model": model.state_dict()}, tied=recipe.tied_pairs(cfg.model))
    tok = load_tokenizer(os.path.join(run, "tokenizer.json"))
    torch.manual_seed(int(opts["seed"]))
    ids = tok.encode(opts["prompt"]) or [tok.eos_id]
    out = sample(model, ids, int(opts["tokens"]), float(opts["temperature"]), int(opts["top_k"]),
                 int(cfg.model[CONTEXT[cfg.recipe.name]]))
    text = tok.decode(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
