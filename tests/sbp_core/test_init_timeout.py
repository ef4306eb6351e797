"""Two timeouts (``process_groups``): waits inside ``initialising()`` may take ``SBP_INIT_TIMEOUT``, every
other wait ``SBP_TIMEOUT``, on groups built under either, for gloo's sends, receives and collectives alike."""
from __future__ import annotations

import contextlib

import pytest
import torch

LATE_S, TIMEOUT_S, INIT_TIMEOUT_S = 2.0, 1.0, 30.0


@contextlib.contextmanager
def _bounds(steady: float, init: float):
    """``process_groups``' two timeouts set for the block, then put back."""
    from sbp_core import process_groups

    saved = process_groups._timeout_s, process_groups._init_timeout_s
    try:
        process_groups.set_init_timeout(init)
        process_groups.set_timeout(steady)
        yield process_groups
    finally:
        process_groups.set_timeout(saved[0])
        process_groups.set_init_timeout(saved[1])


def _late_peer(where: str, op: str, tag: str):
    """Rank 1 joins a transfer (``op``: ``p2p`` or ``all_reduce``) on a fresh group ``LATE_S`` late; rank 0 waits
    for it ``inside`` or ``outside`` an ``initialising`` block. The group is built in the other state than the
    wait's, so the bound must follow the wait, not the group's birth. Returns (what rank 0 got, its wait in s)."""
    import time

    import torch.distributed as dist

    from sbp_core.boxing import collectives

    inside = where == "inside"
    dist.barrier()  # under the pool's own timeout: the group below is built by ranks in step, within any bound
    with _bounds(TIMEOUT_S, INIT_TIMEOUT_S) as process_groups:
        with contextlib.nullcontext() if inside else process_groups.initialising():
            group = process_groups.channel_group(f"late-{tag}", (0, 1))
        with process_groups.initialising() if inside else contextlib.nullcontext():
            start = time.monotonic()
            try:
                if dist.get_rank() == 1:
                    time.sleep(LATE_S)
                if op == "p2p" and dist.get_rank() == 1:
                    collectives.send_tensor(torch.arange(3.0), 0, group)
                    got = "sent"
                elif op == "p2p":
                    got = collectives.recv_tensor((3,), torch.float32, 1, group).tolist()
                else:
                    t = torch.ones(1)
                    dist.all_reduce(t, group=group)
                    got = t.item()
            except RuntimeError as exc:
                got = f"{type(exc).__name__}: {exc}"
            waited = time.monotonic() - start
    dist.barrier()  # under the pool's own timeout: both ranks are past the transfer before the next test's
    return got, waited


@pytest.mark.parametrize("op", ["p2p", "all_reduce"])
def test_a_late_peer_is_waited_for_inside_initialising_and_not_outside(op):
    from toolkit.rank_pool import get_pool

    pool = get_pool(2)
    (got, waited), _ = pool.run(_late_peer, "inside", op, f"in-{op}")
    assert got == ([0.0, 1.0, 2.0] if op == "p2p" else 2.0), got
    assert waited >= LATE_S - 0.1
    (got, waited), _ = pool.run(_late_peer, "outside", op, f"out-{op}")
    assert isinstance(got, str) and ("Timed out" in got or "timed out" in got or "timeout" in got), got
    if op == "p2p":
        assert got.startswith("CollectiveError") and f"timeout {TIMEOUT_S:g} s" in got, got
    assert waited < LATE_S, waited


def test_initialising_widens_the_bound_and_restores_it():
    with _bounds(30.0, 100.0) as process_groups:
        assert process_groups.get_timeout() == 30.0
        with process_groups.initialising():
            assert process_groups.get_timeout() == 100.0
            with process_groups.initialising():
                assert process_groups.get_timeout() == 100.0
            assert process_groups.get_timeout() == 100.0
        assert process_groups.get_timeout() == 30.0
        process_groups.set_init_timeout(10.0)  # never below the steady one
        with process_groups.initialising():
            assert process_groups.get_timeout() == 30.0
        with pytest.raises(ValueError, match="positive"):
            process_groups.set_init_timeout(0)


def _late_for_a_collective_begun_inside(tag: str):
    """Rank 0 starts an all-reduce inside ``initialising()`` and waits for it after the block has ended; rank 1
    joins ``LATE_S`` late, after rank 0's bound. Returns (what rank 0 got, its wait in s)."""
    import time

    import torch.distributed as dist

    from sbp_core.boxing import collectives

    dist.barrier()  # as in _late_peer: the ranks build the group in step
    with _bounds(TIMEOUT_S / 2, TIMEOUT_S) as process_groups:
        group = process_groups.channel_group(f"begun-inside-{tag}", (0, 1))
        start = time.monotonic()
        try:
            if dist.get_rank() == 1:
                time.sleep(LATE_S)
            t = torch.ones(1)
            with process_groups.initialising():
                pending = collectives.Pending(dist.all_reduce(t, group=group, async_op=True), lambda: t, (0, 1))
            got = pending.wait().item()
        except RuntimeError as exc:
            got = f"{type(exc).__name__}: {exc}"
        waited = time.monotonic() - start
    dist.barrier()
    return got, waited


def test_a_failed_wait_names_the_bound_it_started_under():
    """The collective began under the init bound and waits under it after the block: its error says so."""
    from toolkit.rank_pool import get_pool

    (got, waited), _ = get_pool(2).run(_late_for_a_collective_begun_inside, "a")
    assert got.startswith("CollectiveError") and f"timeout {TIMEOUT_S:g} s" in got, got
    assert TIMEOUT_S - 0.2 <= waited < LATE_S, waited
