"""Three AdamW steps of an MLP, a tiny GPT-2 and a tiny LLaMA under every layout equal one device training on its own.

The same layouts and bars as ``python scripts/verify_parity.py``: data parallel
(2, 4), Megatron tensor parallel (2, 4), 2x2 data x tensor, sequence parallel,
layouts the cost model chose from the weights' SBP alone, and dropout. The
reference is never fed our gradients; float64 is held to 1e-9, float32 to its
stated bars (loss, gradients, final parameters).
"""
import pytest

from benchkit.parity import TOLERANCE, layouts, run_layout
from toolkit.rank_pool import get_pool


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(layouts()))
def test_layout_matches_one_device(name, dtype):
    res = [r for r in get_pool(5).run(run_layout, name, dtype) if r is not None]
    errs = [max(r[k] for r in res) for k in range(3)]
    assert all(e <= bar for e, bar in zip(errs, TOLERANCE[dtype])), (errs, TOLERANCE[dtype])
