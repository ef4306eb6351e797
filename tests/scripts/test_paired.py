"""scripts/paired.py: the per-repeat ratio's median and its bootstrap interval."""
import pytest

from scripts.paired import paired_ratio


def test_paired_ratio_is_the_median_of_per_repeat_ratios_and_drift_cancels():
    base = [1.0, 2.0, 4.0, 8.0, 16.0]  # the machine slows down repeat after repeat
    other = [b * 1.25 for b in base]  # 0.8x base's throughput in every repeat
    assert paired_ratio(base, other) == pytest.approx((0.8, 0.8, 0.8))
    mid, lo, hi = paired_ratio([1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 0.5, 1.0])
    assert mid == 1.0 and lo <= mid <= hi and lo >= 0.5 and hi <= 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
