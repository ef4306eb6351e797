"""AdamW parameter groups and the warmup + cosine schedule."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from toolkit.optim import build_optimizer, build_scheduler, lr_at, param_groups

TRAINER = OmegaConf.create(dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, weight_decay=0.1,
                                betas=[0.9, 0.95], eps=1e-8))


def tiny_gpt2():
    from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def test_decay_on_weights_only():
    model = tiny_gpt2()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert "transformer.wte.weight" in decay["names"] and "transformer.h.0.attn.c_attn.weight" in decay["names"]
    assert "transformer.h.0.ln_1.weight" in no_decay["names"] and "transformer.h.0.mlp.c_fc.bias" in no_decay["names"]
    assert "lm_head.weight" not in decay["names"]  # tied to wte: once
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == sum(p.numel() for p in model.parameters())


def test_frozen_parameters_are_left_out():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    decay, no_decay = param_groups(model.named_parameters(), 0.5)
    assert decay["names"] == ["weight"] and no_decay["params"] == []


def test_build_optimizer_from_config():
    opt = build_optimizer(tiny_gpt2(), TRAINER)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 and g["lr"] == 1e-3 for g in opt.param_groups)


def test_lr_values():
    f = lambda s: lr_at(s, 1e-3, 1e-4, 10, 110)  # noqa: E731
    assert f(0) == pytest.approx(1e-4)  # first step already moves: lr / warmup
    assert f(4) == pytest.approx(5e-4)
    assert f(9) == pytest.approx(1e-3) and f(10) == pytest.approx(1e-3)
    assert f(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way: mean of lr and min_lr
    assert f(35) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(110) == pytest.approx(1e-4) and f(500) == pytest.approx(1e-4)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_no_warmup_and_constant():
    assert lr_at(0, 1.0, 0.0, 0, 10) == pytest.approx(1.0)
    assert lr_at(5, 1.0, 1.0, 2, 10) == 1.0
    assert lr_at(3, 1.0, 0.5, 10, 10) == pytest.approx(0.4)  # warmup == max_steps


@pytest.mark.parametrize("args, fragment", [
    ((0, 1.0, 2.0, 1, 10), "min_lr=2.0"),
    ((0, 1.0, 0.1, -1, 10), "warmup_steps=-1"),
])
def test_lr_argument_errors(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        lr_at(*args)


def test_scheduler_follows_lr_at():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, TRAINER)
    sched = build_scheduler(opt, TRAINER)
    seen = []
    for _ in range(115):
        seen.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == seen[-1]
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, 1e-3, 1e-4, 10, 110) for s in range(115)])


def _stepped(model, cfg, steps: int = 30) -> tuple:
    """``(optimizer, scheduler)`` of ``cfg`` after ``steps`` steps."""
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt, sched


def test_scheduler_resume_matches_uninterrupted():
    model = torch.nn.Linear(2, 2)
    opt, sched = _stepped(model, TRAINER)
    state = sched.state_dict()
    opt2 = build_optimizer(model, TRAINER)
    sched2 = build_scheduler(opt2, TRAINER)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    opt3 = build_optimizer(model, TRAINER)
    build_scheduler(opt3, TRAINER, last_step=29)  # steps 0..29 were taken: the next one is 30
    assert opt3.param_groups[0]["lr"] == pytest.approx(lr_at(30, 1e-3, 1e-4, 10, 110))


def test_scheduler_rejects_bad_config():
    bad = OmegaConf.merge(TRAINER, {"min_lr": 1.0})
    with pytest.raises(ValueError, match="min_lr"):
        build_scheduler(build_optimizer(torch.nn.Linear(2, 2), TRAINER), bad)


@pytest.mark.cuda
def test_cuda_parameters_get_a_fused_optimizer():
    model = torch.nn.Linear(4, 3).cuda()
    assert build_optimizer(model, TRAINER).defaults["fused"] is True
    assert not build_optimizer(model, TRAINER, fused=False).defaults["fused"]


def test_cpu_parameters_keep_torch_default_kernels():
    assert not build_optimizer(torch.nn.Linear(4, 3), TRAINER).defaults.get("fused")


@pytest.mark.parametrize("hooked", [False, True])
def test_a_dispatched_step_runs_without_the_fused_kernel_and_restores_it(hooked):
    """The step count moves where a later fused step on the locals reads it, only where one can follow: an
    optimizer with step hooks always dispatches, and its single-tensor steps read the count on the host."""
    from sbp_core.local_step import _dispatched_step

    p = torch.nn.Parameter(torch.empty(3, device="meta"))  # stands for a parameter on a GPU

    class Probe(torch.optim.SGD):
        elementwise = True  # steps on locals (sbp_core.steps_on_locals) unless hooked
        seen = None

        def __init__(self):  # not torch's: meta parameters
            self.param_groups = [{"fused": True, "params": [p]}, {"fused": None, "params": []}]
            self.state = {}
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

        def step(self):
            Probe.seen = [g["fused"] for g in self.param_groups]
            self.state[p] = {"step": torch.tensor(1.0, dtype=torch.float64)}  # a single-tensor step's host count

    opt = Probe()
    if hooked:
        opt._optimizer_step_pre_hooks[0] = lambda *a: None
    _dispatched_step(opt)
    assert Probe.seen == [False, None] and [g["fused"] for g in opt.param_groups] == [True, None]
    step = opt.state[p]["step"]
    if hooked:
        assert step.device.type == "cpu" and step.dtype == torch.float64
    else:  # where the next fused step's kernel reads it
        assert step.device == p.device and step.dtype == torch.float32


def test_scheduler_resume_after_the_first_step():
    """``last_step=0`` (one step taken, no scheduler state): a fresh optimizer gets step 1's learning rate."""
    opt = build_optimizer(torch.nn.Linear(2, 2), TRAINER)
    build_scheduler(opt, TRAINER, last_step=0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr_at(1, 1e-3, 1e-4, 10, 110)] * 2)


def test_tied_pairs_given_twice_are_one_parameter_stepped_once():
    """``named_parameters(remove_duplicate=False)`` lists a tied weight under both names: the groups hold it
    once (its first name), so AdamW steps it once, as ``torch.optim.AdamW`` over the module's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    decay, no_decay = param_groups(list(model.named_parameters(remove_duplicate=False)), 0.1)
    assert decay["names"] == ["0.weight"] and len(decay["params"]) == 1 and no_decay["params"] == []
    ref = torch.nn.Parameter(model[0].weight.detach().clone())
    opt, opt_ref = torch.optim.AdamW([decay, no_decay], lr=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1)
    g = torch.randn(5, 3)
    model[0].weight.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    opt_ref.step()
    torch.testing.assert_close(model[0].weight.detach(), ref.detach(), rtol=1e-6, atol=1e-7)


def test_a_resumed_run_follows_the_configs_schedule_and_settings():
    """After the checkpoint's optimizer and scheduler state dicts: ``follow_config`` puts back the config's
    settings and its schedule's learning rate at the step reached (the rate the trainer logs)."""
    from toolkit.optim import follow_config, settings

    model = torch.nn.Linear(2, 2)
    opt, sched = _stepped(model, TRAINER)

    def resumed(cfg) -> tuple:  # built from cfg, then the saved run's state dicts loaded
        o, s = _stepped(model, cfg, steps=0)
        built = settings(o)
        o.load_state_dict(opt.state_dict())
        s.load_state_dict(sched.state_dict())
        return o, s, built

    opt2, sched2, built = resumed(OmegaConf.merge(TRAINER, dict(lr=5e-4, max_steps=200, weight_decay=0.2)))
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(30, 1e-3, 1e-4, 10, 110))  # the saved run's
    changed = {k: (a, b) for k, a, b in follow_config(opt2, sched2, built)}
    want = lr_at(30, 5e-4, 1e-4, 10, 200)
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([want] * len(opt2.param_groups))
    assert sched2.get_last_lr() == pytest.approx([want] * len(opt2.param_groups))
    assert changed["initial_lr"] == (1e-3, 5e-4) and changed["weight_decay"] == (0.1, 0.2)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(31, 5e-4, 1e-4, 10, 200))
    opt3, sched3, built = resumed(TRAINER)  # the same config: nothing changes
    assert follow_config(opt3, sched3, built) == [] and opt3.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_settings_are_the_configs_hyper_parameters_alone():
    """``settings`` takes the config's hyper-parameters alone: not LazyAdamW's ``dense_state`` (the loaded
    state has the saved run's form) nor ``fused`` (``load_optimizer_state_dict`` keeps the current one's)."""
    from toolkit.lazy_adam import LazyAdamW
    from toolkit.optim import HYPER_PARAMETERS, settings

    opt = LazyAdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=1e-3, dense_state=True)
    (got,) = settings(opt)
    assert "dense_state" not in got and set(got) <= set(HYPER_PARAMETERS) and got["eps"] == 1e-8
    assert "fused" not in settings(build_optimizer(torch.nn.Linear(2, 2), TRAINER))[0]


@pytest.mark.parametrize("saved_kernel, resumed_kernel", [("foreach", "fused"), ("fused", "foreach")])
def test_a_resume_keeps_this_runs_kernel_flags(saved_kernel, resumed_kernel):
    """A checkpoint of a non-fused optimizer (CPU) resumes fused (CUDA), and the reverse: the kernel flags
    are the resumed optimizer's, its ``step`` counters placed for its kernel, and its next step is the
    saved run's next step."""
    from toolkit.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)

    def adamw(m, kernel):
        return torch.optim.AdamW(m.parameters(), lr=1e-2, **{kernel: True})

    def step(m, opt):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()

    saved_opt = adamw(model, saved_kernel)
    for _ in range(3):
        step(model, saved_opt)
    saved = copy.deepcopy(optimizer_state_dict(saved_opt, model))  # as read from disk: not the optimizer's own
    resumed = torch.nn.Linear(4, 3)
    resumed.load_state_dict(model.state_dict())
    opt = adamw(resumed, resumed_kernel)
    load_optimizer_state_dict(opt, resumed, saved)
    group = opt.param_groups[0]
    assert group.get(resumed_kernel) is True and not group.get(saved_kernel)
    assert opt.state[resumed.weight]["step"].item() == 3
    step(model, saved_opt)
    step(resumed, opt)
    for a, b in zip(resumed.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
