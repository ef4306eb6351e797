"""Stage boundaries of several tensors, of any shapes and dtypes, train as one device does.

A toy model whose repeated layers change width (8 -> 6 -> 5 -> 4) and whose
stages hand over three tensors: the hidden state (float, its width the
producing layer's), an integer tensor (per-row offsets: no gradient goes
back for it) and a second float tensor of another shape (a running sum of
the hidden states, so its gradient flows back beside the first's). The
boundaries come from ``toolkit.stages.boundary_specs`` (the stages run on
meta tensors). pp2 and pp4 (one device per stage: plain tensors, the last
backward split into its input and weight passes) and dp2_pp2 (global
tensors), 3 SGD steps of 4 micro-batches in float64: every step's loss and
every parameter after the last step equal one device training on its own
(its own forward, backward and SGD over the same micro-batches) within
1e-12 relative.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from toolkit.rank_pool import get_pool

WIDTHS = (8, 6, 5, 4, 4)  # the first module's output, then each layer's
N, M, STEPS = 8, 4, 3  # rows per micro-batch, micro-batches per step
LAYOUTS = {"pp2": (1, 2), "pp4": (1, 4), "dp2_pp2": (2, 2)}
PLAN = {"layers": "layers", "first": ["first"], "last": ["last"]}


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, WIDTHS[0])
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.last = nn.Linear(WIDTHS[-1], 1)


def stage_forward(module, x, labels=None):
    """The first stage reads ``x`` and ``k`` (int64 offsets); a stage returns ``(hidden, k, total)``."""
    if isinstance(x, dict):
        h, k = module.first(x["x"]), x["k"]
        total = h.sum(1, keepdim=True)
    else:
        h, k, total = x
    for layer in module.layers:
        if layer is not None:
            h = torch.tanh(layer(h)) + 0.01 * k.unsqueeze(1).to(h.dtype)
            total = total + h.sum(1, keepdim=True)
    if module.last is None:
        return h, k, total
    return ((module.last(h) + 0.1 * total - labels["y"]) ** 2).mean()


def _batch(step: int, k: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + k)
    return {"x": torch.randn(N, 3, generator=g, dtype=torch.float64), "k": torch.randint(0, 5, (N,), generator=g),
            "y": torch.randn(N, 1, generator=g, dtype=torch.float64)}


def _reference():
    torch.manual_seed(0)
    model = Toy().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for k in range(M):
            b = _batch(step, k)
            loss = stage_forward(model, {"x": b["x"], "k": b["k"]}, {"y": b["y"]})
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _run(layout: str):
    import sbp_core as sc
    from runtime.pipeline import PipelineConfig, PipelineStep
    from sbp_core.process_groups import world_rank
    from sbp_core.sbp import Split
    from toolkit.mesh import stage_placements
    from toolkit.stages import boundary_specs, keep_stage, stage_ranges

    dp, pp = LAYOUTS[layout]
    me = world_rank()
    placements = stage_placements(dp, 1, pp)
    stage = me // dp if me < dp * pp else None
    ranges = stage_ranges(len(WIDTHS) - 1, pp)
    batch = {"x": ((N, 3), torch.float64), "k": ((N,), torch.int64), "y": ((N, 1), torch.float64)}
    acts = boundary_specs(lambda: Toy().double(), stage_forward, PLAN, ranges, batch, ("x", "k"))
    module = opt = None
    if stage is not None:
        torch.manual_seed(0)
        module = keep_stage(Toy().double(), PLAN, ranges, stage)
        sc.distribute_module(module, placements[stage], {})
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    d = me % dp

    def batches(step, k):
        return {f: t.tensor_split(dp)[d] for f, t in _batch(step, k).items()}

    cfg = PipelineConfig(placements, M, batch, acts, (Split(0), Split(0)), (Split(0), Split(0)), ("x", "k"), ("y",),
                         timeout=60)
    step = PipelineStep(cfg, module, opt, stage_forward, batches)
    losses = [step.step(i) for i in range(STEPS)]
    losses = None if losses[0] is None else [float(x) for x in losses]
    params = {} if module is None else {n: p.full_tensor().detach() for n, p in module.named_parameters()}
    return acts, losses, params


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tuple_boundaries_of_mixed_shapes_and_dtypes_match_one_device(layout):
    want_losses, want_params = _reference()
    res = get_pool(4).run(_run, layout)
    acts, losses, _ = res[0]
    assert all(len(b) == 3 and b[1][1] == torch.int64 for b in acts), acts  # (hidden, k, total) at every boundary
    assert len({b[0][0] for b in acts}) == len(acts), acts  # the hidden width changes from boundary to boundary
    assert losses is not None
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    seen = {}
    for _, _, params in res:
        seen.update(params)
    assert set(seen) == set(want_params)
    for name, got in seen.items():
        want = want_params[name]
        assert (got - want).abs().max() <= 1e-12 * want.abs().max(), name
