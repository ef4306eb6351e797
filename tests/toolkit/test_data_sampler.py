"""GlobalBatchSampler and micro_batch_rows: deterministic, resumable, exact partitions."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.data.sampler import GlobalBatchSampler, micro_batch_rows


def test_same_seed_same_rows_other_seed_other_rows():
    a, b, c = GlobalBatchSampler(1000, 32, seed=7), GlobalBatchSampler(1000, 32, seed=7), GlobalBatchSampler(1000, 32, 8)
    for step in (0, 1, 30, 31, 500):
        assert torch.equal(a.rows(step), b.rows(step))
        assert a.rows(step).dtype == torch.int64 and a.rows(step).shape == (32,)
    assert not torch.equal(a.rows(0), c.rows(0))


def test_an_epoch_visits_distinct_rows_and_batches_never_straddle_epochs():
    s = GlobalBatchSampler(103, 10, seed=1)
    assert s.steps_per_epoch == 10
    for epoch in range(3):
        steps = range(epoch * 10, epoch * 10 + 10)
        seen = torch.cat([s.rows(k) for k in steps])
        assert len(set(seen.tolist())) == 100 and int(seen.min()) >= 0 and int(seen.max()) < 103
        assert torch.equal(seen, s.permutation(epoch)[:100])
        assert all(s.epoch_of(k) == epoch for k in steps)
    assert not torch.equal(s.permutation(0), s.permutation(1))


def test_rows_do_not_depend_on_the_order_steps_are_asked_in():
    s = GlobalBatchSampler(50, 5, seed=3)
    forward = [s.rows(k) for k in range(25)]
    fresh = GlobalBatchSampler(50, 5, seed=3)
    backward = [fresh.rows(k) for k in reversed(range(25))][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward))


def test_resuming_from_a_state_dict_continues_with_the_same_rows():
    run = GlobalBatchSampler(64, 8, seed=11)
    for _ in range(13):
        run.next()
    state = run.state_dict()
    resumed = GlobalBatchSampler(64, 8, seed=11)
    resumed.load_state_dict(state)
    assert resumed.step == 13
    for _ in range(20):
        assert torch.equal(resumed.next(), run.next())


def test_a_state_from_another_sampler_is_refused():
    state = GlobalBatchSampler(64, 8, seed=11).state_dict()
    with pytest.raises(ValueError, match="sampler state has seed=11 but this sampler has seed=12"):
        GlobalBatchSampler(64, 8, seed=12).load_state_dict(state)


@pytest.mark.parametrize("kwargs,message", [
    ({"n_sequences": 4, "global_batch": 8}, "global_batch=8 exceeds n_sequences=4"),
    ({"n_sequences": 0, "global_batch": 1}, "n_sequences must be a positive int, got 0"),
    ({"n_sequences": 8, "global_batch": 2, "step": -1}, "step must be a non-negative int, got -1"),
])
def test_bad_sampler_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GlobalBatchSampler(**kwargs)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 60), accum=st.integers(1, 7), dp=st.integers(1, 7), seed=st.integers(0, 2**31))
def test_shares_over_micro_batches_and_ranks_are_exactly_the_global_batch(n, accum, dp, seed):
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1000
    shares = [[micro_batch_rows(rows, accum, j, dp, r) for r in range(dp)] for j in range(accum)]
    assert torch.equal(torch.cat([s for micro in shares for s in micro]), rows)
    for j, micro in enumerate(shares):
        assert torch.equal(torch.cat(micro), rows.tensor_split(accum)[j])
        sizes = [len(s) for s in micro]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # S(0): first n % p hold one more


@pytest.mark.parametrize("args,message", [
    ((4, 4, 2, 0), r"micro must be an int in \[0, accum=4\), got 4"),
    ((4, 0, 2, 2), r"dp_rank must be an int in \[0, dp_size=2\), got 2"),
    ((0, 0, 1, 0), "accum must be a positive int, got 0"),
])
def test_bad_share_arguments(args, message):
    accum, micro, dp, rank = args
    with pytest.raises(ValueError, match=message):
        micro_batch_rows(torch.arange(8), accum, micro, dp, rank)


def test_one_global_batch_per_epoch_is_allowed():
    s = GlobalBatchSampler(8, 8, seed=3)
    assert s.steps_per_epoch == 1 and sorted(s.rows(0).tolist()) == list(range(8))


def test_a_state_of_another_global_batch_is_refused():
    saved = GlobalBatchSampler(100, 10, seed=1, step=4).state_dict()
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatchSampler(100, 20, seed=1).load_state_dict(saved)
