"""sync_probe's reading of the ranks' stamps: lag, segment, latency and share, by hand."""
import pytest

from benchkit.sync_probe import pair_rounds


def test_pair_rounds_by_hand():
    # one pair, two rounds: (start, reached the all-reduce, left it, CPU seconds of the matmul)
    rank0 = [(0.0, 4.0, 5.0, 4.0), (5.0, 7.0, 8.0, 1.0)]
    rank1 = [(0.0, 2.0, 5.0, 2.0), (5.0, 9.0, 9.5, 4.0)]
    lag, segment, latency, share = pair_rounds([rank0, rank1])
    # gaps 2 and 2: the later rank is 1 after the pair's mean; segments (4+2)/2 and (2+4)/2
    assert (lag, segment) == pytest.approx((1.0, 3.0))
    # the later rank's time in the all-reduce: rank 0 in round 1 (1.0), rank 1 in round 2 (0.5)
    assert latency == pytest.approx(0.75)
    # CPU over wall of each matmul: 1, 1, 0.5, 1
    assert share == pytest.approx(0.875)
