"""benchkit/paired.py: the per-repeat ratio's median and its bootstrap interval."""
import pytest

from collections import Counter

from benchkit.paired import balanced_orders, paired_ratio


def test_paired_ratio_is_the_median_of_per_repeat_ratios_and_drift_cancels():
    base = [1.0, 2.0, 4.0, 8.0, 16.0]  # the machine slows down repeat after repeat
    other = [b * 1.25 for b in base]  # 0.8x base's throughput in every repeat
    assert paired_ratio(base, other) == pytest.approx((0.8, 0.8, 0.8))
    mid, lo, hi = paired_ratio([1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 0.5, 1.0])
    assert mid == 1.0 and lo <= mid <= hi and lo >= 0.5 and hi <= 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


@pytest.mark.parametrize("n", [2, 4, 5])
def test_balanced_orders_put_every_way_in_every_slot_and_after_every_other_way_alike(n):
    names = [f"w{k}" for k in range(n)]
    orders = balanced_orders(names)
    assert len(orders) == (2 * n if n % 2 else n) and all(sorted(o) == names for o in orders)
    slots = Counter((i, w) for o in orders for i, w in enumerate(o))
    assert set(slots.values()) == {len(orders) // n} and len(slots) == n * n
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert set(follows.values()) == {len(orders) // n} and len(follows) == n * (n - 1)
