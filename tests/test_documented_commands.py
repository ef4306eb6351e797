"""Every command the README and docs/ show is one the code accepts.

Collects the lines of the fenced ``bash`` blocks of README.md and docs/**.md
that run ``train.py``, a script under ``scripts/`` or ``-m scripts.reproduce``
(after any ``VAR=value`` prefix or ``torchrun ...``), and checks each without
running it:

- ``train.py``: the overrides compose with Hydra and pass ``validate`` for
  their recipe, as ``train.py`` does before it starts a process (a
  ``-m`` sweep is checked value by value; ``device=cuda`` is checked as the
  config it is, on a machine without CUDA too; a user's absolute
  ``data.path``, ``data.tokenizer`` or ``trainer.init_from`` that is not on
  this machine by a stand-in file or directory);
- a script: its argument parser accepts the options (the script's ``main``
  runs up to ``parse_args`` and stops there).

Commands that need files of their own (``hydra.searchpath=...``, the
tutorial's) run in ``tests/test_writing_a_recipe.py``; the two install
commands at the top of the README are what CI runs.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _commands():
    """``(file, line)`` of every documented python command."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    while words and re.fullmatch(r"[A-Za-z_]+=.*", words[0]):
                        words = words[1:]  # VAR=value prefixes
                    if words[:1] == ["torchrun"]:
                        words = ["python"] + [w for w in words[1:] if not w.startswith("-") and not w.isdigit()]
                    if words[:1] == ["python"] and len(words) > 1 and (
                            words[1] == "train.py" or words[1].startswith("scripts/")
                            or words[1:3] == ["-m", "scripts.reproduce"]):
                        out.append((doc.relative_to(ROOT).as_posix(), words[1:]))
    return out


COMMANDS = _commands()


def test_the_docs_show_commands():
    files = {f for f, _ in COMMANDS}
    assert "README.md" in files and len(COMMANDS) >= 20, sorted(files)


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _stop_after_parse():
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        original(self, args, namespace)  # argparse exits with status 2 on options it does not know
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _check_script(module_name: str, argv: list) -> None:
    module = importlib.import_module(module_name)
    saved = sys.argv
    sys.argv = [module_name] + argv
    try:
        with _stop_after_parse(), pytest.raises(_Parsed):
            module.main()
    finally:
        sys.argv = saved


# Paths the docs show as a user's own files: checked as stand-ins of the kind each key needs.
_STAND_INS = {"data.path": "corpus.txt", "data.tokenizer": "tokenizer.json", "trainer.init_from": "hf_dir/"}


def _stand_in(override: str, tmp, overrides: list) -> str:
    """``key=/a/users/path`` -> ``key=<a stand-in under tmp>`` where the path does not exist here: for
    ``trainer.init_from``, a Hugging Face directory of the command's model, as far as validation looks."""
    key, _, value = override.partition("=")
    if key not in _STAND_INS or not value.startswith("/") or pathlib.Path(value).exists():
        return override
    kind = _STAND_INS[key]
    path = tmp / kind.rstrip("/")
    if kind.endswith("/"):
        path.mkdir(exist_ok=True)
        _hf_dir_of([o for o in overrides if o != override], path)
        (path / "tokenizer.json").write_text("{}")
    else:
        path.write_text("text")
    return f"{key}={path}"


def _hf_dir_of(overrides: list, path) -> None:
    """The ``config.json`` of the Hugging Face model the command's model settings describe, and a
    ``model.safetensors`` with its tensors' headers (``tests.hf_stand_in``: no data)."""
    from recipes.registry import get
    from tests.hf_stand_in import hf_shapes, write_headers
    from toolkit.config import compose

    cfg = compose([o for o in overrides if not o.startswith("hydra.")], run_dir="/tmp/doc-command")
    if cfg.recipe.name == "llama":
        from recipes.llama.config import llama_config_kwargs
        from recipes.llama.hf import hf_config

        config = hf_config(llama_config_kwargs(cfg.model))
    else:
        config = {k: int(cfg.model[k]) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")}
    (path / "config.json").write_text(json.dumps(config))
    write_headers(path / "model.safetensors", hf_shapes(get(cfg.recipe.name), cfg.model))


def _check_train(overrides: list, tmp) -> None:
    from recipes.registry import get
    from toolkit.config import compose, validate

    sweep = "-m" in overrides
    overrides = [o for o in overrides if o != "-m"]
    variants = [[]]
    for o in overrides:
        key, _, value = o.partition("=")
        values = value.split(",") if sweep and "," in value and "[" not in value else [value]
        variants = [v + [f"{key}={x}"] for v in variants for x in values]
    for v in variants:
        if any(o.startswith("hydra.searchpath") for o in v):
            pytest.skip("needs the tutorial's files: tests/test_writing_a_recipe.py runs it")
        v = [o.replace("device=cuda", "device=cpu") for o in v if not o.startswith("hydra.")]
        cfg = compose([_stand_in(o, tmp, v) for o in v], run_dir="/tmp/doc-command")
        if cfg.parallel.auto:
            continue  # the search picks the layout at run time; composing is what can be checked here
        validate(cfg, get(cfg.recipe.name))


@pytest.mark.parametrize("doc, words", COMMANDS, ids=[f"{d}: {' '.join(w)[:70]}" for d, w in COMMANDS])
def test_documented_command_is_accepted(doc, words, tmp_path):
    if words[0] == "train.py":
        _check_train(words[1:], tmp_path)
    elif words[0] == "-m":
        _check_script(words[1] + ".__main__" if words[1] == "scripts.reproduce" else words[1], words[2:])
    else:
        _check_script(words[0].removesuffix(".py").replace("/", "."), words[1:])
