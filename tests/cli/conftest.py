import pytest


@pytest.fixture(scope="session")
def sbp_cache(tmp_path_factory):
    """One tokenizer and token-file cache for every ``train.py`` run of the session."""
    return str(tmp_path_factory.mktemp("sbp-cache"))
