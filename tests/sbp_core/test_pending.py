"""``collectives.Pending`` with a follow-up: when the first collective is waited for, and what each wait gives."""
from __future__ import annotations

import pytest

from sbp_core.boxing.collectives import Pending


class _Work:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def wait(self, *args):
        self.events.append(f"wait {self.name}")


@pytest.mark.parametrize("ordered, at_advance", [(False, ["wait first"]), (True, [])])
def test_a_follow_up_starts_after_a_wait_unless_the_two_run_in_order_by_themselves(ordered, at_advance):
    """NCCL's reduce-scatter then all-gather of a bucket (``ordered``): starting the all-gather must not make
    the current stream (backward's) wait for the reduce-scatter; both are waited for by ``wait()``."""
    events = []

    def then(mine):
        events.append(f"start second from {mine}")
        return Pending(_Work("second", events), lambda: mine + "+second", (0, 1))

    pending = Pending(_Work("first", events), lambda: "first's output", (0, 1), then=then, ordered=ordered)
    pending.advance()
    assert events == [*at_advance, "start second from first's output"]
    assert pending.wait() == "first's output+second"
    assert events[len(at_advance) + 1:] == ["wait second"] + (["wait first"] if ordered else [])
