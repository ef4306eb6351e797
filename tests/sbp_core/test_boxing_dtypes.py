"""Global tensors of every dtype box exactly, including those gloo and NCCL do not take as they are.

The values are small integers, exact in every dtype here, so results are
compared byte for byte with the single-device tensor: the pieces laid out
by the destination SBP, partial terms summed in int64 and cast back.
Covers the planned collectives (even pieces on 2 ranks), the general ones
(uneven pieces on 3 ranks), transfers across placements, the runtime's
point-to-point channels (a tensor alone, and inside a pickled message),
and the clear refusal of reductions no backend can run
(``sbp_core/boxing/wire.py``).
"""
import pytest
import torch

from scripts.verify_boxing import WORLD
from toolkit.rank_pool import get_pool

DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.int32, torch.bool,
          torch.complex64, torch.float8_e4m3fn, torch.float16]
SUMMED = [torch.int16, torch.uint16, torch.uint32, torch.int32, torch.bool, torch.complex64, torch.float16]
# (source ranks, source SBP, destination ranks, destination SBP, shape); each partial rank holds one term.
PAIRS = [([0, 1], "S0", [0, 1], "B", (4, 6)), ([0, 1], "S0", [0, 1], "S1", (4, 6)),
         ([0, 1], "B", [0, 1], "S1", (4, 6)), ([0, 1, 2], "S0", [0, 1, 2], "B", (7, 5)),
         ([0, 1, 2], "S1", [0, 1, 2], "S0", (7, 5)), ([0, 1], "S0", [2], "B", (4, 6)),
         ([0, 1], "B", [2, 3, 4], "S0", (7, 5))]
PARTIAL_PAIRS = [([0, 1], "P", [0, 1], "B", (4, 6)), ([0, 1], "P", [0, 1], "S0", (4, 6)),
                 ([0, 1, 2], "P", [0, 1, 2], "S1", (7, 5)), ([0, 1, 2], "P", [0, 1, 2], "B", (7, 5)),
                 ([0, 1], "P", [2, 3], "B", (4, 6))]


def _sbp(name):
    from sbp_core import sbp

    return {"S0": sbp.split(0), "S1": sbp.split(1), "B": sbp.broadcast, "P": sbp.partial_sum}[name]


def _terms(shape, n, seed):
    """``n`` partial terms of small non-negative integers (int64), the same on every process."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 6, shape, generator=g) for _ in range(n)]


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    return (t != 0) if dtype == torch.bool else t.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _sent_back(t: torch.Tensor):
    """What a worker returns of a tensor: torch cannot unpickle the unsigned dtypes' storages."""
    return t.dtype, tuple(t.shape), _bytes(t).clone()


def _cases():
    out = [(dt, pair) for dt in DTYPES for pair in PAIRS]
    return out + [(dt, pair) for dt in SUMMED for pair in PARTIAL_PAIRS]


def _want(case, idx):
    """The global value: the source's one tensor, or its partial terms summed (int64, then cast)."""
    dtype, (src_ranks, src, _, _, shape) = case
    terms = _terms(shape, len(src_ranks) if src == "P" else 1, idx)
    return terms, _as(sum(terms), dtype)


def _box_all(cases):
    import sbp_core as sc
    from sbp_core.layout import take_local

    me = torch.distributed.get_rank()
    got = []
    for idx, case in enumerate(cases):
        dtype, (src_ranks, src, dst_ranks, dst, shape) = case
        terms, full = _want(case, idx)
        local = None
        if me in src_ranks:
            k = src_ranks.index(me)
            local = (_as(terms[k], dtype) if src == "P"
                     else take_local(full, (len(src_ranks),), (_sbp(src),), (k,)))
        x = sc.to_global(local, placement=sc.placement("cpu", src_ranks), sbp=_sbp(src))
        y = x.to_global(placement=sc.placement("cpu", dst_ranks), sbp=_sbp(dst))
        got.append(_sent_back(y.to_local()) if me in dst_ranks else None)
    return got


def test_every_dtype_boxes_to_the_single_device_tensor():
    from sbp_core.layout import take_local

    cases = _cases()
    out = get_pool(WORLD).run(_box_all, cases)
    bad = []
    for idx, case in enumerate(cases):
        dtype, (src_ranks, src, dst_ranks, dst, shape) = case
        _, full = _want(case, idx)
        for k, r in enumerate(dst_ranks):
            want = take_local(full, (len(dst_ranks),), (_sbp(dst),), (k,))
            have = out[r][idx]
            if have[:2] != (dtype, tuple(want.shape)) or not torch.equal(have[2], _bytes(want)):
                bad.append(f"{dtype} {src_ranks} {src} -> {dst_ranks} {dst}: rank {r} has {have[:2]}")
    assert len(cases) > 90 and not bad, "\n".join(bad)


def _reduce_refused(dtype, op):
    import sbp_core as sc
    from sbp_core import sbp

    me = torch.distributed.get_rank()
    part = sbp.partial_sum if op == "sum" else sbp.partial_max
    x = sc.to_global(torch.ones(4, 6).to(dtype), placement=sc.placement("cpu", list(range(WORLD))), sbp=part)
    try:
        x.to_global(sbp=sbp.broadcast)
    except TypeError as exc:
        return me, str(exc)
    return me, None


@pytest.mark.parametrize("dtype, op", [(torch.uint64, "sum"), (torch.float8_e4m3fn, "sum"),
                                       (torch.complex64, "max")])
def test_a_reduction_no_backend_runs_is_refused_on_every_rank_with_the_dtype_named(dtype, op):
    pool = get_pool(WORLD)
    out = pool.run(_reduce_refused, dtype, op)
    assert [r for r, _ in out] == list(range(WORLD))
    for _, message in out:
        assert message and f"cannot reduce {dtype} tensors across ranks with {op}" in message
    assert pool.run(torch.distributed.get_world_size) == [WORLD] * WORLD  # nothing left waiting


def _channels():
    """Rank 0 sends each value through the runtime's two point-to-point forms; rank 1 receives them."""
    from sbp_core.boxing import collectives
    from sbp_core.process_groups import group_of

    group = group_of(list(range(WORLD)))
    values = [_as(torch.arange(12).reshape(3, 4) % 7, dt) for dt in DTYPES]
    me = torch.distributed.get_rank()
    got = []
    for v in values:
        if me == 0:
            collectives.send_object(v, 1, group)
            collectives.send_tensor(v, 1, group)
            collectives.send_object({"value": v[:, 1:], "step": 3}, 1, group)  # pickled, a tensor inside
        elif me == 1:
            got.append([_sent_back(collectives.recv_object(0, group)),
                        _sent_back(collectives.recv_tensor(v.shape, v.dtype, 0, group))])
            message = collectives.recv_object(0, group)
            got[-1].append((_sent_back(message["value"]), message["step"]))
    return got


def test_the_runtime_channels_carry_every_dtype_alone_and_inside_a_pickled_message():
    got = get_pool(WORLD).run(_channels)[1]
    for dtype, (as_object, as_tensor, (inside, step)) in zip(DTYPES, got):
        want = _as(torch.arange(12).reshape(3, 4) % 7, dtype)
        for have in (as_object, as_tensor):
            assert have[:2] == (dtype, (3, 4)) and torch.equal(have[2], _bytes(want)), dtype
        assert inside[:2] == (dtype, (3, 3)) and torch.equal(inside[2], _bytes(want[:, 1:])) and step == 3, dtype
