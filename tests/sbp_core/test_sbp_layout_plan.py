"""Single-process checks: SBP values, placements, shard geometry, the boxing planner and costs."""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sbp_core as sc
from sbp_core import sbp
from sbp_core.boxing.cost import disjoint, same_placement
from sbp_core.boxing.nd_plan import plan
from sbp_core.layout import local_box, shard_bounds, take_local
from sbp_core.sbp import nd_sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum


def test_reprs_equality_hashing_pickling():
    assert [repr(s) for s in (S0, sbp.split(3), B, P, sbp.partial_max, sbp.partial_min)] == [
        "S(0)", "S(3)", "B", "P(sum)", "P(max)", "P(min)"]
    assert sbp.split(1) == S1 and hash(sbp.split(1)) == hash(S1) and S0 != S1 and P != sbp.partial_max
    for s in (S1, B, sbp.partial_min):
        assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(AttributeError):
        S0.axis = 2


def test_bad_sbp_values():
    with pytest.raises(ValueError, match="non-negative"):
        sbp.split(-1)
    with pytest.raises(ValueError, match=r"'mean' is not one of \('sum', 'max', 'min'\)"):
        sc.sbp.Partial("mean")
    with pytest.raises(ValueError, match="has 2 entries but the placement's mesh has 1 axes"):
        nd_sbp((S0, B), 1)
    with pytest.raises(TypeError, match="sbp entries must be"):
        nd_sbp(("S0",), 1)


def test_placement_geometry_and_identity():
    p = sc.placement("cpu", [0])
    assert p.shape == (1,) and p.ranks == (0,) and p.coords(0) == (0,)
    assert p == sc.placement("cpu", [0]) and hash(p) == hash(sc.placement("cpu", 0))
    assert p != sc.placement("cpu", [[0]])
    with pytest.raises(ValueError, match=r"placement ranks \[1\] are not in the world: valid ranks are 0..0"):
        sc.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match="device type 'tpu' is not one of"):
        sc.placement("tpu", [0])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9))
def test_shard_bounds_follow_tensor_split(size, parts):
    pieces = torch.tensor_split(torch.arange(size), parts)
    for i, piece in enumerate(pieces):
        start, length = shard_bounds(size, parts, i)
        assert torch.equal(torch.arange(start, start + length), piece)


def test_nested_split_boxes():
    full = torch.arange(7 * 6).reshape(7, 6)
    # (S(0), S(0)) on 2x2: axis 0 halves the rows (4, 3), axis 1 halves each half again.
    got = [take_local(full, (2, 2), (S0, S0), (i, j)) for i in range(2) for j in range(2)]
    want = [q for h in torch.tensor_split(full, 2, 0) for q in torch.tensor_split(h, 2, 0)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert local_box((7, 6), (2, 3), (S0, S1), (1, 2)) == ((4, 3), (4, 2))


def test_partial_layout_is_exact():
    full = torch.randn(3, 2)
    terms = [take_local(full, (2, 2), (P, sbp.partial_max), (i, j)) for i in range(2) for j in range(2)]
    # global = sum over axis 0 of max over axis 1
    value = torch.max(terms[0], terms[1]) + torch.max(terms[2], terms[3])
    assert torch.equal(value, full)


def test_planner_orders_steps_to_minimise_bytes():
    # 256-byte tensor: gather quarters into halves (2 groups x 128), then halves (2 x 256).
    steps, cost = plan((S0, S1), (B, B), (2, 2), (8, 8), 4)
    assert cost == 2 * 128 + 2 * 256 and sorted(a for a, _ in steps) == [0, 1]
    # (P, S(0)) -> (B, B): reducing the half-size shards before gathering is cheaper.
    steps, cost = plan((P, S0), (B, B), (2, 2), (8, 8), 4)
    assert steps == ((0, B), (1, B))
    assert cost == 2 * (2 * 128) + 2 * 256
    # (S(0), S(0)) nests on one dim: the inner axis must be undone first.
    steps, _ = plan((S0, S0), (B, B), (2, 2), (8, 8), 4)
    assert steps[0][0] == 1


def test_cost_table():
    T = 100.0
    assert same_placement(S0, S1, 4, T) == 75 and same_placement(S0, B, 4, T) == 300
    assert same_placement(P, S0, 4, T) == 300 and same_placement(P, B, 4, T) == 600
    assert same_placement(B, P, 4, T) == same_placement(S0, P, 4, T) == same_placement(B, S0, 4, T) == 0
    assert disjoint(S0, B, 2, 3, T) == 300 and disjoint(P, B, 2, 3, T) == 400 and disjoint(P, P, 2, 3, T) == 200
    assert disjoint(B, S1, 2, 3, T) == disjoint(S0, S1, 2, 3, T) == disjoint(B, P, 2, 3, T) == 100
