"""Hydra config tree: composition, the typed schema, parallel layout names (files and generated)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hydra.errors import HydraException
from hypothesis import given, strategies as st
from omegaconf import OmegaConf

from recipes.gpt2.config import ModelConfig as GPT2ModelConfig, gpt2_config_kwargs
from recipes.gpt2.recipe import RECIPE as GPT2
from toolkit.config import (CONFIG_DIR, ConfigError, compose, load_config, parallel_name, parse_parallel_name,
                            save_resolved_config, typed, validate)
from toolkit.config.schema import ParallelConfig, TrainConfig

DOCUMENTED_LAYOUTS = ["single", "dp2", "tp2", "pp2", "dp2_tp2", "dp2_tp2_pp2", "dp2_tp4_pp2",
                      "dp4_zero2", "dp2_tp2_zero3"]
MODELS = {  # name: (vocab, positions, embd, layers, heads)
    "gpt2-tiny": (8192, 256, 128, 4, 4),
    "gpt2": (50257, 1024, 768, 12, 12),
    "gpt2-medium": (50257, 1024, 1024, 24, 16),
    "gpt2-large": (50257, 1024, 1280, 36, 20),
    "gpt2-xl": (50257, 1024, 1600, 48, 25),
}


def test_default_composition_is_typed_and_complete():
    cfg = compose(run_dir="/tmp/run")
    assert OmegaConf.get_type(cfg) is TrainConfig
    assert OmegaConf.get_type(cfg.parallel) is ParallelConfig
    assert cfg.recipe.name == "gpt2" and cfg.model.name == "gpt2-tiny" and cfg.data.source == "stdlib"
    assert cfg.logger.backend == "wandb" and cfg.trainer.precision == "fp32" and cfg.device == "auto"
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero) == (1, 1, 1, 0)
    assert cfg.data.seq_len == cfg.model.n_positions == 256  # interpolated
    assert cfg.data.vocab_size == cfg.model.vocab_size == 8192
    assert cfg.run_dir == "/tmp/run"
    assert OmegaConf.missing_keys(cfg) == set()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_presets(name):
    cfg = compose([f"model={name}"], run_dir="/tmp/run")
    m = cfg.model
    assert (m.vocab_size, m.n_positions, m.n_embd, m.n_layer, m.n_head) == MODELS[name]
    assert m.name == name and m.dropout == 0.0


def test_model_dropout_sets_three_pdrops():
    from recipes.gpt2.model import GPT2Config

    cfg = compose(["model.dropout=0.1"], run_dir="/tmp/run")
    gc = GPT2Config(**gpt2_config_kwargs(cfg.model))
    assert (gc.embd_pdrop, gc.resid_pdrop, gc.attn_pdrop) == (0.1, 0.1, 0.1)
    assert (gc.vocab_size, gc.n_layer, gc.n_head, gc.n_embd, gc.n_positions) == (8192, 4, 4, 128, 256)


def test_gpt2_tiny_fits_tp_and_pp_up_to_4():
    m = compose(run_dir="/tmp/run").model
    for d in (1, 2, 4):
        assert m.n_head % d == 0 and m.vocab_size % d == 0 and m.n_layer % d == 0


@pytest.mark.parametrize("name", DOCUMENTED_LAYOUTS)
def test_documented_layout_files_equal_the_parsed_name(name):
    assert (CONFIG_DIR / "parallel" / f"{name}.yaml").is_file()
    p = compose([f"parallel={name}"], run_dir="/tmp/run").parallel
    assert {k: p[k] for k in ("dp", "cp", "tp", "pp", "zero")} == parse_parallel_name(name)


@pytest.mark.parametrize("name, expected", [
    ("dp3_tp2", (3, 2, 1, 0)),
    ("pp4", (1, 1, 4, 0)),
    ("tp2_pp3_dp5_zero1", (5, 2, 3, 1)),
    ("zero3_dp8", (8, 1, 1, 3)),
])
def test_any_layout_name_without_a_file(name, expected):
    assert not (CONFIG_DIR / "parallel" / f"{name}.yaml").exists()
    p = compose([f"parallel={name}"], run_dir="/tmp/run").parallel
    assert (p.dp, p.tp, p.pp, p.zero) == expected
    assert p.pp_schedule == "1f1b" and p.stage_layers is None  # schema defaults fill the rest


def test_layout_name_then_field_overrides():
    p = compose(["parallel=dp3_tp2", "parallel.pp=2", "parallel.pp_schedule=gpipe",
                 "parallel.stage_layers=[1,3]"], run_dir="/tmp/run").parallel
    assert (p.dp, p.tp, p.pp, p.pp_schedule, list(p.stage_layers)) == (3, 2, 2, "gpipe", [1, 3])


def test_field_form():
    p = compose(["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
                run_dir="/tmp/run").parallel
    assert (p.dp, p.tp, p.pp, p.sequence_parallel) == (2, 2, 2, True)


@pytest.mark.parametrize("bad, fragment", [
    ("parallel=dp2_ep2", "part 'ep2' is not a layout part"),
    ("parallel=dp2_dp4", "appears twice"),
    ("parallel=dp2_zero4", "ZeRO stage 4 does not exist"),
    ("parallel=tp0", "must be at least 1"),
    ("parallel=sigle", "valid: 'single'"),
])
def test_malformed_layout_name_fails_at_composition_with_the_grammar(bad, fragment):
    with pytest.raises(HydraException) as info:
        compose([bad])
    assert fragment in str(info.value)
    assert "valid:" in str(info.value)


@pytest.mark.parametrize("bad, fragment", [
    ("trainer.lrr=1", "lrr"),
    ("trainer.lr=fast", "fast"),
    ("parallel.dp=two", "two"),
    ("model.n_layr=2", "n_layr"),
])
def test_unknown_keys_and_wrong_types_fail_at_composition(bad, fragment):
    with pytest.raises(HydraException) as info:
        compose([bad])
    text = str(info.value) + repr(info.value.__cause__)
    assert fragment in text


def test_keys_added_with_plus_are_rejected_by_validate():
    cfg = compose(["+parallel.ep=2"], run_dir="/tmp/run")  # Hydra lets '+' add keys ...
    with pytest.raises(ConfigError, match=r"parallel\.ep: Key 'ep' not in 'ParallelConfig'"):
        validate(cfg, GPT2)  # ... the schema does not


@pytest.mark.parametrize("bad, fragment", [
    ("model.n_layer=1.5", r"model\.n_layer: Value '1\.5' .* could not be converted to Integer"),
    ("+model.n_inner=64", r"model\.n_inner: Key 'n_inner' not in 'ModelConfig'"),
    ("+data.shuffle=true", r"data\.shuffle: Key 'shuffle' not in 'DataConfig'"),
])
def test_recipe_groups_are_typed_by_the_recipe_schema(bad, fragment):
    """``model`` and ``data`` belong to the recipe: its dataclasses catch what composition cannot."""
    with pytest.raises(ConfigError, match=fragment) as info:
        validate(compose([bad], run_dir="/tmp/run"), GPT2)
    assert "recipes.gpt2.config" in str(info.value) and "(recipe gpt2)" in str(info.value)
    typed_cfg = typed(compose(run_dir="/tmp/run"), GPT2)
    assert OmegaConf.get_type(typed_cfg.model) is GPT2ModelConfig


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(HydraException) as info:
        compose(["model=gpt3"])
    assert "gpt2-medium" in str(info.value)


def test_logger_none_and_data_text():
    cfg = compose(["logger=none", "data=text", "data.path=/tmp/corpus.txt"], run_dir="/tmp/run")
    assert cfg.logger.backend == "none" and cfg.logger.project == "sbp-recipes"
    assert cfg.data.source == "text" and cfg.data.path == "/tmp/corpus.txt" and cfg.data.max_bytes is None


def test_typed_rejects_unknown_keys_in_plain_dicts():
    with pytest.raises(Exception, match="nope"):
        typed({"trainer": {"nope": 1}})
    assert typed({"parallel": {"dp": 2}}).parallel.dp == 2


def test_resolved_config_round_trip(tmp_path):
    cfg = compose(["parallel=dp2_tp2", "model.dropout=0.1"], run_dir=str(tmp_path))
    path = save_resolved_config(cfg, tmp_path)
    text = path.read_text()
    assert "${" not in text and f"run_dir: {tmp_path}" in text
    back = load_config(tmp_path)
    assert OmegaConf.get_type(back) is TrainConfig
    assert OmegaConf.to_container(back) == OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        load_config(tmp_path / "missing")


# -- layout names ---------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("single", dict(dp=1, cp=1, tp=1, pp=1, zero=0)),
    ("dp2_tp4_pp2_zero1", dict(dp=2, cp=1, tp=4, pp=2, zero=1)),
    ("pp2_dp2", dict(dp=2, cp=1, tp=1, pp=2, zero=0)),
    ("zero2", dict(dp=1, cp=1, tp=1, pp=1, zero=2)),
    ("dp1", dict(dp=1, cp=1, tp=1, pp=1, zero=0)),
    ("tp2_cp4_dp2", dict(dp=2, cp=4, tp=2, pp=1, zero=0)),
])
def test_parse_parallel_name(name, expected):
    assert parse_parallel_name(name) == expected


@pytest.mark.parametrize("name, fragment", [
    ("", "non-empty"),
    ("dp", "lacks its number"),
    ("dp2__tp2", "part ''"),
    ("dp2-tp2", "part 'dp2-tp2'"),
    ("DP2", "part 'DP2'"),
    ("dp2_dp2", "appears twice"),
    ("zero9", "zero0, zero1, zero2 or zero3"),
    ("pp0", "pp0 must be at least 1"),
])
def test_parse_parallel_name_errors(name, fragment):
    with pytest.raises(ConfigError) as info:
        parse_parallel_name(name)
    assert fragment in str(info.value) and repr(name) in str(info.value)
    assert isinstance(info.value, ValueError)


degree = st.integers(min_value=1, max_value=64)


@given(degree, degree, degree, st.integers(min_value=0, max_value=3), degree, st.randoms())
def test_name_round_trip_any_order(dp, tp, pp, zero, cp, rnd):
    canonical = parallel_name(dp, tp, pp, zero, cp)
    assert parse_parallel_name(canonical) == dict(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero)
    parts = [f"dp{dp}", f"cp{cp}", f"tp{tp}", f"pp{pp}", f"zero{zero}"]
    rnd.shuffle(parts)
    subset = parts[: rnd.randint(1, 5)]
    parsed = parse_parallel_name("_".join(subset))
    for part in subset:
        key = part.rstrip("0123456789")
        assert parsed[key] == int(part[len(key):])


def test_parallel_name_canonical():
    assert parallel_name() == "single"
    assert parallel_name(2, 1, 2) == "dp2_pp2"
    assert parallel_name(4, zero=2) == "dp4_zero2"
    assert parallel_name(2, 2, zero=1, cp=4) == "dp2_cp4_tp2_zero1"


# -- the command line ---------------------------------------------------------------

APP = """
import sys
sys.path.insert(0, {root!r})
import hydra
from toolkit.config import CONFIG_DIR, validate

@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def main(cfg):
    from recipes.registry import get

    layout = validate(cfg, get(cfg.recipe.name), world_size=cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp)
    print("LAYOUT", layout.name, layout.world_size, layout.accumulation, cfg.run_dir, flush=True)

if __name__ == "__main__":
    main()
"""


def test_command_line_and_multirun_resolve_layout_names(tmp_path):
    """``parallel=<name>`` on a real command line and in a sweep, including names without a file."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(APP.format(root=str(CONFIG_DIR.parent))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, str(app), "-m", "parallel=dp2_tp2,tp2_pp2_dp2,pp4",
                          "logger=none", "trainer.global_batch_size=32", f"hydra.sweep.dir={tmp_path}/sweep"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    lines = sorted(line.split()[1:4] for line in run.stdout.splitlines() if line.startswith("LAYOUT"))
    assert lines == [["dp2_tp2", "4", "4"], ["dp2_tp2_pp2", "8", "4"], ["pp4", "4", "8"]]
    assert f"{tmp_path}/sweep/0" in run.stdout  # run_dir is Hydra's output dir

    bad = subprocess.run([sys.executable, str(app), "parallel=dp2_xp2"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "part 'xp2' is not a layout part" in bad.stderr
