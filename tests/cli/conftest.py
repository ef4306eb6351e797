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

    run = tmp_path_factory.mktemp("single")
    losses = train_pooled([*TINY, "parallel=single"], run, sbp_cache)
    assert len(losses) == 3 and losses[-1] < losses[0]
    return run, losses
