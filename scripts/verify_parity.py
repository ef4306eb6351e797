"""Train an MLP and a tiny GPT-2 under many layouts and compare with one device.

    python scripts/verify_parity.py

Each layout trains 3 AdamW steps (fp32, dropout 0 but in one layout) from the same seed and the
same batches as a single-device run in the same process; for every step it
compares the loss, every parameter's gradient, and after the optimizer step
every parameter (max relative difference, ``max|a-b| / max|b|`` per tensor).
The single-device AdamW steps with the distributed run's gradients: Adam's
``g / (|g| + eps)`` amplifies fp32 summation-order noise up to
``lr / (4 eps)``-fold where ``|g|`` is near ``eps``, so two runs that differ
only in reduction order drift apart by ~1e-5 after one step. Feeding both
optimizers the same gradients keeps the parameters equal, so each step's
loss and gradients measure the layout alone, and the parameter check
measures our optimizer path (local shards, boxed gradients) alone. Layouts: data parallel on 2 and 4 ranks,
Megatron tensor parallel on 2 and 4 ranks, data x tensor on a 2x2 mesh, the
same with sequence-parallel LayerNorm regions (GPT-2), a layout where the
cost model chose every activation layout from the weights' SBP alone, and
data x tensor with dropout 0.1 (both runs draw from one RNG state). Last
line: ``parity: K/K layouts within 1e-5``.
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
from sbp_core.sbp import Broadcast, Split  # noqa: E402

WORLD = 4
STEPS = 3
ADAMW = dict(lr=1e-3, weight_decay=0.1)
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

# Megatron's tensor-parallel layout of GPT-2, on the tp mesh axis.
GPT_TP = {
    "*.attn.c_attn.weight": S1, "*.attn.c_attn.bias": S0, "*.attn.c_proj.weight": S0,
    "*.mlp.c_fc.weight": S1, "*.mlp.c_fc.bias": S0, "*.mlp.c_proj.weight": S0,
    "transformer.wte.weight": S0,
}
# Megatron keeps the residual stream whole between the parallel regions.
GPT_TP_PINS = {"*.ln_1:input": B, "*.ln_2:input": B, "transformer.ln_f:input": B}
# Sequence parallel: LayerNorm regions split along the sequence.
GPT_SP_PINS = {"*.ln_1:input": S1, "*.ln_2:input": S1, "transformer.ln_f:input": S1}
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


def _model_and_batches(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
        batches = [(torch.randn(16, 32), torch.randint(0, 8, (16,))) for _ in range(STEPS)]
    else:
        p = 0.1 if kind == "gpt2-dropout" else 0.0
        model = GPT2LMHeadModel(dataclasses.replace(GPT_CFG, embd_pdrop=p, resid_pdrop=p, attn_pdrop=p))
        batches = [(ids, ids) for ids in (torch.randint(0, GPT_CFG.vocab_size, (4, 16)) for _ in range(STEPS))]
    return model, batches


def _loss(kind, model, x, y):
    return model(x, y) if kind == "mlp" else model(x, y)[1]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def run_layout(name):
    """Worker: train ``name`` and the single-device reference; return the max relative differences."""
    kind, ranks, plan, in_sbp = layouts()[name]
    ref, batches = _model_and_batches(kind)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    model, _ = _model_and_batches(kind)
    p = sc.placement("cpu", ranks)
    sc.distribute_module(model, p, plan)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    me = torch.distributed.get_rank()
    worst_loss = worst_grad = worst_param = 0.0
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
        params = {n: q.full_tensor() for n, q in model.named_parameters()}
        if me in p:
            worst_loss = max(worst_loss, _rel(value, ref_loss.detach()))
            for n, q in ref.named_parameters():
                worst_grad = max(worst_grad, _rel(grads[n], q.grad))
                q.grad.copy_(grads[n])
            ref_opt.step()
            ref_opt.zero_grad()
            for n, q in ref.named_parameters():
                worst_param = max(worst_param, _rel(params[n], q.detach()))
    return (worst_loss, worst_grad, worst_param) if me in p else None


def main():
    from toolkit.rank_pool import get_pool

    pool = get_pool(WORLD)
    good = 0
    names = list(layouts())
    for name in names:
        res = [r for r in pool.run(run_layout, name) if r is not None]
        loss_err = max(r[0] for r in res)
        grad_err = max(r[1] for r in res)
        param_err = max(r[2] for r in res)
        ok = max(loss_err, grad_err, param_err) <= 1e-5
        good += ok
        print(f"{name:36s} loss {loss_err:.2e}  grads {grad_err:.2e}  params {param_err:.2e}  {'ok' if ok else 'FAIL'}")
    print(f"parity: {good}/{len(names)} layouts within 1e-5")
    return 0 if good == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
