"""Bad input fails with a clear error on every rank; a collective nobody joins times out."""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

WORLD = 5


def _errors(fn, *args):
    outs = get_pool(WORLD).outcomes(fn, *args)
    assert all(not o.ok for o in outs), [o.value for o in outs if o.ok]
    return outs


def _split_axis_out_of_range():
    sc.to_global(torch.zeros(2, 3), placement=sc.placement("cpu", range(5)), sbp=sbp.split(2))


def test_split_axis_out_of_range():
    for o in _errors(_split_axis_out_of_range):
        assert o.exc_type == "ValueError"
        assert "split axis 2" in o.message and "valid axes are 0..1" in o.message


def _ranks(ranks):
    sc.placement("cpu", ranks)


@pytest.mark.parametrize(
    "ranks,words",
    [([0, 1, 1], "repeat rank(s) [1]"), ([0, 7], "[7] are not in the world: valid ranks are 0..4"),
     ([0, 5], "[5] are not in the world"), ([[0, 1], [2]], "rectangular")],
)
def test_bad_placement_ranks(ranks, words):
    for o in _errors(_ranks, ranks):
        assert o.exc_type == "ValueError" and words in o.message


def _disagreeing_shards(what):
    me = torch.distributed.get_rank()
    p = sc.placement("cpu", [0, 1, 2, 3, 4])
    if what == "shape":
        local = torch.zeros(3 if me == 1 else 2, 4)  # S(0) of 11 rows would give 3,2,2,2,2
        sc.to_global(local, placement=p, sbp=sbp.split(0))
    elif what == "other_dim":
        sc.to_global(torch.zeros(2, 5 if me == 3 else 4), placement=p, sbp=sbp.split(0))
    elif what == "broadcast":
        sc.to_global(torch.zeros(2 + (me == 4)), placement=p, sbp=sbp.broadcast)
    elif what == "dtype":
        sc.to_global(torch.zeros(2, dtype=torch.float64 if me == 2 else torch.float32), placement=p, sbp=sbp.broadcast)
    elif what == "device":
        sc.to_global(torch.zeros(2), placement=sc.placement("cuda", [0, 1, 2, 3, 4]), sbp=sbp.broadcast)


@pytest.mark.parametrize(
    "what,words",
    [
        ("shape", "rank 0's shard has shape [2, 4] but sbp (S(0)) of a global [11, 4] tensor gives it [3, 4]"),
        ("other_dim", "rank 3's shard has shape [2, 5]"),
        ("broadcast", "rank 4's shard has shape [3]"),
        ("dtype", "rank 2 has torch.float64"),
        ("device", "device type 'cpu' but the placement is 'cuda'"),
    ],
)
def test_disagreeing_shards_raise_on_every_rank(what, words):
    outs = _errors(_disagreeing_shards, what)
    for o in outs:
        assert o.exc_type == "ValueError" and words in o.message, o.message
    assert len({o.message for o in outs}) == 1  # the same error everywhere


def _wrong_sbp_arity():
    sc.randn(4, 4, placement=sc.placement("cpu", [[0, 1], [2, 3]]), sbp=sbp.split(0))


def test_sbp_must_match_the_mesh():
    for o in _errors(_wrong_sbp_arity):
        assert "has 1 entries but the placement's mesh has 2 axes" in o.message


def _one_rank_skips():
    me = torch.distributed.get_rank()
    x = sc.distribute(torch.arange(4.0), sc.placement("cpu", [0, 1]), sbp.split(0))
    if me == 1:
        return "skipped"
    return x.to_global(sbp=sbp.broadcast)


def test_a_collective_one_rank_never_joins_times_out():
    pool = get_pool(2, timeout=3.0)
    outs = pool.outcomes(_one_rank_skips)
    assert outs[1].ok and outs[1].value == "skipped"
    assert not outs[0].ok and outs[0].exc_type == "CollectiveError"
    assert "all_gather with ranks [0, 1] failed on rank 0" in outs[0].message
    # The pool restarts its workers after a failed collective and works again.
    assert pool.run(torch.distributed.get_world_size) == [2, 2]


@pytest.mark.parametrize("send", ["send_object", "send_tensor"])
def test_a_failed_point_to_point_send_names_the_peer(send):
    from unittest import mock

    from sbp_core.boxing import collectives

    def lost(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    with mock.patch.object(collectives.dist, "isend", lost), pytest.raises(collectives.CollectiveError) as err:
        getattr(collectives, send)(torch.zeros(3), 1, None)
    assert f"{send} with ranks [1] failed on rank 0" in str(err.value) and "Connection closed" in str(err.value)


def _cast(kind):
    p = sc.placement("cpu", [0, 1])
    if kind == "truncating":
        sc.cast(sc.distribute(torch.ones(4), p, sbp.broadcast), dtype=torch.int32)
    else:  # the gradient of a cast out of a partial max has no defined layout
        x = sc.distribute(torch.randn(4, 2), p, sbp.partial_max, requires_grad=True)
        sc.cast_group([x], [(sbp.broadcast,)])[0].sum().backward()


@pytest.mark.parametrize("kind,words", [("truncating", "would truncate a torch.float32 tensor"),
                                        ("partial_max_gradient", "(a partial max/min) is not defined")])
def test_casts_that_lose_values_or_have_no_gradient_are_refused(kind, words):
    outcomes = _errors(_cast, kind)
    assert all(o.exc_type == "ValueError" and words in o.message for o in outcomes[:2]), outcomes
