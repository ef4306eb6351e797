"""Run state: ``trainer.init_from=<Hugging Face dir>`` gives the full model transformers' weights before it is
split; ``trainer.resume=auto`` says where it looked when there is nothing to resume."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from recipes.gpt2.recipe import RECIPE
from recipes.gpt2.hf import is_hf_dir
from toolkit.plain_loop import materialized

build_model = RECIPE.build_model


@pytest.mark.parametrize("multiple", [1, 64])  # 64: the 96 ids' rows padded to 128, padded logits -inf
def test_init_from_a_hugging_face_directory_gives_its_logits(tmp_path, multiple):
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    assert is_hf_dir(str(tmp_path))
    model_cfg = OmegaConf.create({**cfg, "dropout": 0.0, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                                  "make_vocab_size_divisible_by": multiple})
    ours = RECIPE.build_stage(model_cfg, lambda m: m).eval()
    assert RECIPE.init_weights(ours, str(tmp_path), OmegaConf.create({"model": model_cfg}))
    materialized(ours)  # each parameter read from the files as distribute_module reads a rank's boxes
    assert ours.lm_head.weight is ours.transformer.wte.weight and len(ours.lm_head.weight) == (96, 128)[multiple > 1]
    ids = torch.randint(0, 96, (2, 16))
    logits = ours(ids)[0]
    assert torch.allclose(logits[..., :96], hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(logits[..., 96:]).all()
    deeper = OmegaConf.merge(model_cfg, {"n_layer": 3})
    with pytest.raises(ValueError, match="its config.json has n_layer=2, the model n_layer=3"):
        RECIPE.init_weights(RECIPE.build_stage(deeper, lambda m: m), str(tmp_path), OmegaConf.create({"model": deeper}))


def test_resume_without_a_checkpoint_says_where_it_looked(tmp_path, capsys):
    from types import SimpleNamespace

    from toolkit import run_state

    job = SimpleNamespace(cfg=SimpleNamespace(run_dir=str(tmp_path)), rank=0)
    assert run_state.resume(job) == 0
    out = capsys.readouterr().out
    assert f"no complete checkpoint under {tmp_path}/checkpoints; starting from step 0" in out
    assert "hydra.run.dir=<run dir>" in out
    run_state.resume(SimpleNamespace(cfg=job.cfg, rank=1))
    assert capsys.readouterr().out == ""  # rank 0 alone says it


def _job_whose_rank_lacks_init_from(container: dict, layout) -> str:
    """Worker: build the job, laid out where it started, with a recipe that finds ``trainer.init_from`` nowhere
    on this machine."""
    from recipes.gpt2.recipe import GPT2Recipe
    from toolkit.trainer import Job

    class Elsewhere(GPT2Recipe):
        def weights_path(self, init_from):
            return None

    try:
        Job(OmegaConf.create(container), Elsewhere(), layout)
    except FileNotFoundError as err:
        return str(err)
    return "built"


def test_a_rank_whose_machine_lacks_init_from_fails_instead_of_training_from_scratch(tmp_path):
    """Validated where the job started, then missing where a rank runs: that rank raises."""
    from toolkit.config import compose, validate
    from toolkit.rank_pool import get_pool

    hf = tmp_path / "hf"
    hf.mkdir()
    # A Hugging Face directory, as far as validation looks: its config.json and its tensors' headers.
    from tests.hf_stand_in import hf_shapes, write_headers

    (hf / "config.json").write_text('{"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 32}')
    cfg = compose(["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.vocab_size=512",
                   "model.n_positions=32", "data.max_bytes=100000", "trainer.eval_every=0", "logger=none",
                   f"trainer.init_from={hf}", f"data.cache_dir={tmp_path / 'cache'}"], run_dir=str(tmp_path / "run"))
    write_headers(hf / "model.safetensors", hf_shapes(RECIPE, cfg.model))
    layout = validate(cfg, RECIPE)
    out = get_pool(1).run(_job_whose_rank_lacks_init_from, OmegaConf.to_container(cfg, resolve=True), layout)[0]
    assert out == f"trainer.init_from={str(hf)!r}: not found on rank 0's machine"


def _newest_as_seen(base: str):
    """Worker: rank r looks at ``base/r`` (rank 0's holds ``step_3``, rank 1's nothing), then both at ``base/0``."""
    import os

    import torch.distributed as dist

    from toolkit import checkpoint as ckpt
    from toolkit.run_state import latest_on_every_rank

    mine = os.path.join(base, str(dist.get_rank()))
    try:
        latest_on_every_rank(mine)
        split = "no error"
    except ckpt.CheckpointError as e:
        split = str(e)
    return split, latest_on_every_rank(os.path.join(base, "0"))


def test_ranks_that_see_different_newest_checkpoints_all_refuse_to_resume(tmp_path):
    """A run directory that is not one filesystem for every rank would let some ranks load (and enter the load's
    collectives) while others start afresh; every rank raises instead, naming what each saw."""
    from toolkit.rank_pool import get_pool

    (tmp_path / "0" / "step_3").mkdir(parents=True)
    (tmp_path / "0" / "step_3" / "manifest.json").write_text("{}")
    (tmp_path / "0" / "latest").write_text("step_3")
    (tmp_path / "1").mkdir()
    for split, agreed in get_pool(2).run(_newest_as_seen, str(tmp_path)):
        assert "the ranks see different newest checkpoints" in split and "rank 0: step_3, rank 1: none" in split
        assert agreed == str(tmp_path / "0" / "step_3")


def test_a_hugging_face_directory_that_does_not_fit_the_model_is_refused_before_spawning(tmp_path):
    """``trainer.init_from=<Hugging Face dir>``: its config.json against model.*, and its weights files' headers
    (every tensor's name and shape, a corrupt header), checked by validation (``Recipe.weights_problems``), as
    ``init_weights`` checks them on every rank."""
    from toolkit.config import ConfigError, compose, validate

    hf = tmp_path / "hf"
    hf.mkdir()
    dims = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (hf / "config.json").write_text(json.dumps(dims))

    def problems(*overrides):
        with pytest.raises(ConfigError) as info:
            validate(compose([f"trainer.init_from={hf}", *overrides], run_dir=str(tmp_path / "run")), RECIPE)
        return "\n".join(info.value.problems)

    assert f"{hf}: no model.safetensors, pytorch_model.bin or their .index.json" in problems("model=gpt2")
    (hf / "model.safetensors").write_text("")  # corrupt: its header cannot be read
    assert f"{hf / 'model.safetensors'} cannot be read: SafetensorError" in problems("model=gpt2")
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_text("")  # an empty download: no reader takes it
    assert f"{hf / 'pytorch_model.bin'} cannot be read: " in problems("model=gpt2")
    (hf / "pytorch_model.bin").unlink()
    from tests.hf_stand_in import hf_shapes, write_headers

    gpt2 = compose(["model=gpt2"], run_dir=str(tmp_path / "run")).model
    shapes = hf_shapes(RECIPE, gpt2)
    write_headers(hf / "model.safetensors", {**shapes, "transformer.h.3.mlp.c_fc.weight": (768, 100)})
    assert "other shapes than the model's: transformer.h.3.mlp.c_fc.weight is [768, 100] there, [768, 3072] here" \
        in problems("model=gpt2")
    write_headers(hf / "model.safetensors", shapes)
    assert validate(compose([f"trainer.init_from={hf}", "model=gpt2"], run_dir=str(tmp_path / "run")), RECIPE)
    assert "its config.json has n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, the model " \
           "n_layer=" in problems()
    (hf / "config.json").write_text("{")
    assert "config.json: not valid JSON" in problems("model=gpt2")
