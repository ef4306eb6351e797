"""Root conftest: makes the repository root importable in tests.

pytest puts this file's directory on ``sys.path``; ``RankPool`` workers
import with this process's ``sys.path`` (``toolkit.child.host_rank_context``),
so they can import test modules such as ``tests.toolkit.test_rank_pool`` and
unpickle the functions the tests send them, even without ``pip install -e .``.

Tests marked ``cuda`` need a GPU: ``pytest -m cuda`` runs them on one, and
everywhere else they are skipped with that reason.
"""

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; `pytest -m cuda` runs these on a GPU machine")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False here)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
