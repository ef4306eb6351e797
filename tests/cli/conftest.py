import pytest


@pytest.fixture(scope="session")
def sbp_cache(tmp_path_factory):
    """One tokenizer and token-file cache for every ``train.py`` run of the session."""
    return str(tmp_path_factory.mktemp("sbp-cache"))


@pytest.fixture(scope="session")
def single_run(tmp_path_factory, sbp_cache):
    """``(run directory, per-step losses)`` of the one-process reference (it also ends with a checkpoint)."""
    from tests.cli.pooled import train_pooled
    from tests.cli.test_train_cli import TINY

    import math

    import torch
    from omegaconf import OmegaConf

    from recipes.gpt2.recipe import RECIPE
    from toolkit import checkpoint as ckpt

    run = tmp_path_factory.mktemp("single")
    losses = train_pooled([*TINY, "parallel=single"], run, sbp_cache)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # It trained: its last checkpoint's weights moved away from where the seed put them. (Three steps of
    # warmup's small learning rates move the loss less than the batches do, so the losses need not fall.)
    cfg = OmegaConf.load(run / "config.yaml")
    torch.manual_seed(int(cfg.trainer.seed))
    start = RECIPE.build_model(cfg.model).state_dict()
    end = ckpt.load(str(run / "checkpoints"), {"model": None})["model"]
    assert all(end[k].shape == start[k].shape for k in end)
    assert 0 < (end["transformer.h.0.mlp.c_fc.weight"] - start["transformer.h.0.mlp.c_fc.weight"]).abs().max() < 0.01
    return run, losses
