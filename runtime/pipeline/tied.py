"""Tied parameters across pipeline stages stay tied: both copies step with the summed gradient.

GPT-2's token embedding (first stage) and LM head (last stage) are one
parameter in the full model; split into stages they are two copies with
equal initial values. After each step's gradient reduction each stage's
gradient is boxed to the other's layout (cross-placement boxing: the
disjoint-placement row of docs/design.md's table, |T| each way for splits) and
added, so both hold ``g_first + g_last`` — bit-identical, since addition
commutes — and the optimizers, starting from equal states, keep the copies
equal.

Both sides start their transfers at ``sum_grads``, once their own
gradients are final: the first stage posts its receptions of the last
stage's gradients, sends a copy of its own and adds what it receives; the
last stage sends its own, waits for the first's and adds them. The first
stage's sends finish while its optimizer steps (``flush`` waits for them).
No reception is posted before its data can exist: under NCCL a receive
posted early (say, before the first stage's last backward) would make any
device-wide synchronisation on that rank in the meantime (the caching
allocator freeing its cache under memory pressure) wait for the last
stage's step end. Under 1F1B the first stage finishes its backwards last,
so the last stage's gradients have long been sent by then.
"""
from __future__ import annotations

import torch

from sbp_core import GlobalTensor, Layout
from sbp_core.boxing import collectives
from sbp_core.boxing.cross_placement import box_cross_placement_start
from sbp_core.process_groups import world_rank, world_size


class TiedGrads:
    def __init__(self, tied: list, module, placements: list, stage: int):
        self.pairs = []
        self._incoming, self._outgoing = None, []  # the first stage's transfers in flight (sum_grads)
        pp = len(placements)
        if pp == 1 or not tied:
            return
        me = world_rank()
        params = dict(module.named_parameters()) if module is not None else {}
        stage = -1 if stage is None else stage
        metas = []
        for first, last in tied:
            name = first if stage == 0 else last if stage == pp - 1 else None
            p = params.get(name) if name else None
            if name and p is None:
                raise ValueError(f"tied parameter {name!r} is not on stage {stage}; its parameters: {sorted(params)[:8]}")
            lead = me == placements[stage].ranks[0]
            metas.append((stage, p.sbp, tuple(p.shape), str(p.dtype)) if p is not None and lead else None)
        gathered = collectives.all_gather_object(metas, list(range(world_size())))
        for k, (first, last) in enumerate(tied):
            layouts = {}
            for rank_metas in gathered:
                meta = rank_metas[k]
                if meta is not None:
                    s, sbp, shape, dtype = meta
                    layouts[s] = Layout(placements[s], sbp, torch.Size(shape), getattr(torch, dtype.split(".")[-1]))
            if set(layouts) != {0, pp - 1}:
                raise ValueError(f"tied pair ({first!r}, {last!r}) must live on the first and last stage")
            name = first if stage == 0 else last if stage == pp - 1 else None
            self.pairs.append((params.get(name), layouts[0], layouts[pp - 1]))

    def copies(self) -> list:
        """This rank's last-stage copies (their gradients duplicate the first stage's after ``sum_grads``)."""
        if not self.pairs:
            return []
        return [p for p, first, _ in self.pairs if p is not None and world_rank() not in first.placement]

    def _here(self) -> list:
        """``[(parameter, on the first stage here, first layout, last layout)]`` for the pairs on this rank."""
        me = world_rank()
        return [(p, me in first.placement, first, last) for p, first, last in self.pairs if p is not None]

    def expect(self) -> None:
        """On the first stage's ranks: post the receptions of the last stage's gradients (once per step,
        before the sends: every rank starts a pair's boxings in one order)."""
        if self._incoming is None:
            self._incoming = [box_cross_placement_start(_absent(last), last, _as(last, first))
                              for _, here_first, first, last in self._here() if here_first]

    @torch.no_grad()
    def sum_grads(self) -> None:
        """On the first and last stage's ranks: both copies' gradients become their sum.

        Each side's gradient is in its parameter's layout (``box_grads`` ran).
        The first stage sends a copy of its gradients (``flush`` waits for
        the sends) and adds the last stage's, received since ``expect``; the
        last stage sends its gradients and, once they are sent, adds the
        first stage's.
        """
        if not self.pairs:
            return
        here = self._here()
        if any(here_first for _, here_first, _, _ in here):
            self.expect()
            self._outgoing = [box_cross_placement_start(p.grad._local.clone(), p.grad.layout, _as(p.grad.layout, last))
                              for p, _, _, last in here]
            incoming, self._incoming = self._incoming, None
            for (p, _, first, last), boxing in zip(here, incoming):
                p.grad.add_(GlobalTensor(boxing.wait(), _as(last, first)))
            return
        outgoing = [box_cross_placement_start(p.grad._local, p.grad.layout, _as(p.grad.layout, first))
                    for p, _, first, _ in here]
        incoming = [box_cross_placement_start(_absent(first), first, _as(first, last)) for _, _, first, last in here]
        for boxing in outgoing:  # the gradients being sent are added to below
            boxing.wait()
        for (p, _, first, last), boxing in zip(here, incoming):
            p.grad.add_(GlobalTensor(boxing.wait(), _as(first, last)))

    def flush(self) -> None:
        """Wait for the first stage's sends started by ``sum_grads``."""
        outgoing, self._outgoing = self._outgoing, []
        for boxing in outgoing:
            boxing.wait()


def _as(src: Layout, dst: Layout) -> Layout:
    """``src``'s tensor laid out as ``dst`` is (its placement and SBP; ``src``'s shape and dtype)."""
    return Layout(dst.placement, dst.sbp, src.shape, src.dtype)


def _absent(layout: Layout) -> torch.Tensor:
    """The local of another placement's tensor as seen from here: no data."""
    return torch.empty(0, dtype=layout.dtype, device=layout.placement.device())
