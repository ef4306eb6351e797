"""Three AdamW steps of an MLP and a tiny GPT-2 equal one device under every layout.

The same layouts as ``python scripts/verify_parity.py``: data parallel (2, 4),
Megatron tensor parallel (2, 4), 2x2 data x tensor, sequence parallel, and
layouts the cost model chose from the weights' SBP alone.
"""
import pytest

from scripts.verify_parity import layouts, run_layout
from toolkit.rank_pool import get_pool


@pytest.mark.parametrize("name", list(layouts()))
def test_layout_matches_one_device(name):
    res = [r for r in get_pool(5).run(run_layout, name) if r is not None]
    loss, grads, params = (max(r[k] for r in res) for k in range(3))
    assert loss <= 1e-5 and grads <= 1e-5 and params <= 1e-5, (loss, grads, params)
