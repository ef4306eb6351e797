"""Root conftest: makes the repository root importable in tests.

pytest puts this file's directory on ``sys.path``; ``RankPool`` workers are
started with ``spawn``, which copies ``sys.path``, so they can import test
modules such as ``tests.toolkit.test_rank_pool`` and unpickle the functions
the tests send them, even without ``pip install -e .``.
"""
