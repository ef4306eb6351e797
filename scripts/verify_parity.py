"""Train an MLP and a tiny GPT-2 under many layouts and compare with one device training on its own.

    python scripts/verify_parity.py [--dtype float64|float32|both]

Each layout trains 3 AdamW steps (dropout 0 but in one layout) from the same
seed and the same batches as a single-device run in the same process. The
single-device run is independent: its own forward, backward and optimizer
step every step, never fed the distributed run's gradients. Compared, as the
max relative difference ``max|a-b| / max|b|`` per tensor: every step's loss
and every parameter's gradient, and every parameter after the last step.

Two modes (bars in ``TOLERANCE``: loss, gradients, final parameters).
``float64``: models and inputs in double precision, where the only
difference between the runs, the order of summation, is ~1e-16; Adam's
``g / (sqrt(v) + eps)`` can amplify it up to ``lr / (4 eps)``-fold (2.5e4
here) where a gradient is near ``eps``, so every bar is ``1e-9`` (measured:
at most ~6e-12). ``float32``: the same training in single precision, where
that amplification turns summation-order noise (~1e-7) into parameter
differences of ~1e-3 after three steps, as large as those between the
float32 reference and the float64 one (the ``floor`` column: the one-device
float32 run against the one-device float64 run); the bars are 1e-5 for the
loss, 1e-4 for the gradients and 1e-2 for the parameters.

Layouts: data parallel on 2 and 4 ranks, Megatron tensor parallel on 2 and
4 ranks, data x tensor on a 2x2 mesh, the same with sequence-parallel
LayerNorm regions (GPT-2), a layout where the cost model chose every
activation layout from the weights' SBP alone, and data x tensor with
dropout 0.1 (both runs draw from one RNG state). Last line:
``parity: K/K layouts within their mode's bars``.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sbp_core as sc  # noqa: E402
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel  # noqa: E402
from recipes.gpt2.plan import RESIDUAL_WHOLE, SEQUENCE_PARALLEL, TENSOR_PARALLEL  # noqa: E402
from sbp_core.sbp import Broadcast, Split  # noqa: E402

WORLD = 4
STEPS = 3
ADAMW = dict(lr=1e-3, weight_decay=0.1)
# (loss, gradients, final parameters): see the module docstring
TOLERANCE = {"float64": (1e-9, 1e-9, 1e-9), "float32": (1e-5, 1e-4, 1e-2)}
B, S0, S1, S2 = Broadcast(), Split(0), Split(1), Split(2)


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, classes=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x), approximate="tanh")), y)


GPT_CFG = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                     embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)

# The recipe's own Megatron layout of GPT-2 on the tp mesh axis (the tied lm_head is wte's parameter, named
# once in a whole model), and the residual stream kept whole.
GPT_TP = {k: v for k, v in TENSOR_PARALLEL.items() if k != "lm_head.weight"}
GPT_TP_PINS = RESIDUAL_WHOLE
# Sequence parallel: LayerNorm regions split along the sequence.
GPT_SP_PINS = SEQUENCE_PARALLEL
MLP_TP = {"fc1.weight": S0, "fc1.bias": S0, "fc2.weight": S1}


def _on_axis(plan, axis_sbp_other, tp_axis, ndim):
    """Put each plan entry's SBP on ``tp_axis`` of an ``ndim`` mesh, ``B`` elsewhere."""
    out = {}
    for k, v in plan.items():
        sbp = [axis_sbp_other] * ndim
        sbp[tp_axis] = v
        out[k] = tuple(sbp)
    return out


def layouts():
    """name -> (model kind, mesh ranks, plan, input SBP)."""
    out = {}
    for kind, tp_plan, pins in (("mlp", MLP_TP, {}), ("gpt2", GPT_TP, GPT_TP_PINS)):
        out[f"{kind} dp2"] = (kind, [0, 1], {}, (S0,))
        out[f"{kind} dp4"] = (kind, [0, 1, 2, 3], {}, (S0,))
        out[f"{kind} tp2"] = (kind, [0, 1], {**tp_plan, **pins}, (B,))
        out[f"{kind} tp4"] = (kind, [0, 1, 2, 3], {**tp_plan, **pins}, (B,))
        out[f"{kind} dp2 x tp2"] = (kind, [[0, 1], [2, 3]], _on_axis({**tp_plan, **pins}, B, 1, 2), (S0, B))
        out[f"{kind} tp2 cost-chosen"] = (kind, [0, 1], dict(tp_plan), (B,))
    out["gpt2 tp2 sequence-parallel"] = ("gpt2", [0, 1], {**GPT_TP, **GPT_SP_PINS}, (B,))
    out["gpt2 dp2 x tp2 sequence-parallel"] = ("gpt2", [[0, 1], [2, 3]], _on_axis({**GPT_TP, **GPT_SP_PINS}, B, 1, 2), (S0, B))
    out["gpt2 dp2 x tp2 cost-chosen"] = ("gpt2", [[0, 1], [2, 3]], _on_axis(GPT_TP, B, 1, 2), (S0, B))
    # Dropout 0.1 everywhere: masks drawn for the global shape equal one device's draws from the same RNG state.
    out["gpt2 dp2 x tp2 dropout"] = ("gpt2-dropout", [[0, 1], [2, 3]], _on_axis({**GPT_TP, **GPT_TP_PINS}, B, 1, 2),
                                     (S0, B))
    return out


def _model_and_batches(kind, dtype=torch.float64):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
        batches = [(torch.randn(16, 32).to(dtype), torch.randint(0, 8, (16,))) for _ in range(STEPS)]
    else:
        p = 0.1 if kind == "gpt2-dropout" else 0.0
        model = GPT2LMHeadModel(dataclasses.replace(GPT_CFG, embd_pdrop=p, resid_pdrop=p, attn_pdrop=p))
        batches = [(ids, ids) for ids in (torch.randint(0, GPT_CFG.vocab_size, (4, 16)) for _ in range(STEPS))]
    return model.to(dtype), batches


def _loss(kind, model, x, y):
    return model(x, y) if kind == "mlp" else model(x, y)[1]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def run_layout(name, dtype: str = "float64"):
    """Worker: train ``name`` and, on its own, the single-device reference; the max relative differences
    ``(loss, gradients, final parameters)`` on the layout's ranks (``None`` elsewhere)."""
    kind, ranks, plan, in_sbp = layouts()[name]
    dt = getattr(torch, dtype)
    ref, batches = _model_and_batches(kind, dt)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    model, _ = _model_and_batches(kind, dt)
    p = sc.placement("cpu", ranks)
    sc.distribute_module(model, p, plan)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    me = torch.distributed.get_rank()
    worst_loss = worst_grad = 0.0
    for x, y in batches:
        rng = torch.get_rng_state()  # both runs draw their dropout masks from one state
        ref_loss = _loss(kind, ref, x, y)
        ref_loss.backward()
        torch.set_rng_state(rng)
        gx = sc.distribute(x, p, in_sbp)
        gy = sc.distribute(y, p, in_sbp)
        loss = _loss(kind, model, gx, gy)
        loss.backward()
        value = loss.full_tensor()
        grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if me in p:
            worst_loss = max(worst_loss, _rel(value, ref_loss.detach()))
            for n, q in ref.named_parameters():
                worst_grad = max(worst_grad, _rel(grads[n], q.grad))
        ref_opt.step()  # the reference's own gradients, its own step
        ref_opt.zero_grad()
    params = {n: q.full_tensor() for n, q in model.named_parameters()}
    if me not in p:
        return None
    worst_param = max(_rel(params[n], q.detach()) for n, q in ref.named_parameters())
    return worst_loss, worst_grad, worst_param, _floor(kind, ref) if dt != torch.float64 else 0.0


def _floor(kind, ref) -> float:
    """How far the one-device run in ``ref``'s precision ends from the same run in float64 (its parameters)."""
    exact, batches = _model_and_batches(kind, torch.float64)
    opt = torch.optim.AdamW(exact.parameters(), **ADAMW)
    for x, y in batches:
        _loss(kind, exact, x, y).backward()
        opt.step()
        opt.zero_grad()
    theirs = dict(exact.named_parameters())
    return max(_rel(q.detach(), theirs[n].detach()) for n, q in ref.named_parameters())


def main(argv=None):
    import argparse

    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="both", choices=["float64", "float32", "both"])
    modes = ["float64", "float32"] if ap.parse_args(argv).dtype == "both" else [ap.parse_args(argv).dtype]
    pool = get_pool(WORLD)
    good = total = 0
    for dtype in modes:
        for name in layouts():
            res = [r for r in pool.run(run_layout, name, dtype) if r is not None]
            errs = [max(r[k] for r in res) for k in range(4)]
            ok = all(e <= bar for e, bar in zip(errs, TOLERANCE[dtype]))
            good, total = good + ok, total + 1
            floor = f"  (floor {errs[3]:.2e})" if dtype != "float64" else ""
            print(f"{dtype} {name:36s} loss {errs[0]:.2e}  grads {errs[1]:.2e}  params {errs[2]:.2e}{floor}  "
                  f"{'ok' if ok else 'FAIL'}")
    print(f"parity: {good}/{total} layouts within their mode's bars")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
