"""Tied parameters across pipeline stages stay tied: both copies step with the summed gradient.

GPT-2's token embedding (first stage) and LM head (last stage) are one
parameter in the full model; split into stages they are two copies with
equal initial values. After each step's gradient reduction the two copies'
gradients are exchanged by cross-placement boxing (each side's gradient
boxed to the other's layout: the disjoint-placement row of DESIGN.md's
table, |T| each way for splits) and added, so both hold ``g_first +
g_last`` — bit-identical, since addition commutes — and the optimizers,
starting from equal states, keep the copies equal.
"""
from __future__ import annotations

import torch

from sbp_core import GlobalTensor, Layout
from sbp_core.boxing import collectives
from sbp_core.boxing.cross_placement import box_cross_placements
from sbp_core.process_groups import world_rank, world_size


class TiedGrads:
    def __init__(self, tied: list, module, placements: list, stage: int):
        self.pairs = []
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
        return [p for p, first, _ in self.pairs if p is not None and world_rank() not in first.placement]

    @torch.no_grad()
    def sum_grads(self) -> None:
        """On the first and last stage's ranks: both copies' gradients become their sum.

        Both directions are boxed in one exchange (``box_cross_placements``), so the two stages send at once.
        """
        for p, first, last in self.pairs:
            if p is None:
                continue
            here_first = world_rank() in first.placement
            from_first = p.grad.layout if here_first else first  # each gradient's layout, as both stages see it
            from_last = p.grad.layout if not here_first else last
            mine, empty = p.grad._local, _absent(p.grad.dtype, p.grad._local.device)
            at_last = Layout(last.placement, last.sbp, from_first.shape, from_first.dtype)
            at_first = Layout(first.placement, first.sbp, from_last.shape, from_last.dtype)
            to_last, to_first = box_cross_placements([
                (mine if here_first else empty, from_first, at_last),
                (empty if here_first else mine, from_last, at_first),
            ])
            p.grad.add_(GlobalTensor(to_first, at_first) if here_first else GlobalTensor(to_last, at_last))


def _absent(dtype, device) -> torch.Tensor:
    """The local of the other stage's tensor as seen from here: no data."""
    return torch.empty(0, dtype=dtype, device=device)
