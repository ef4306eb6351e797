"""AdamW (or SGD) with weight decay on weights only, and the warmup + cosine learning-rate schedule.

Weight decay applies to parameters with 2 or more dimensions (matmul weights
and embeddings) and not to biases or LayerNorm gains/shifts (1-D). The
dimension test uses the parameter's *global* shape (a global tensor reports
its global shape), so every rank of a sharded layout groups parameters alike.
Tied parameters (``lm_head.weight`` is ``wte.weight``) appear once.

Schedule, for the optimizer step with index ``s`` (0 for the first step; a
``LambdaLR`` is stepped once after every ``optimizer.step()``)::

    s <  warmup_steps:           lr * (s + 1) / warmup_steps
    warmup_steps <= s < max:     min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,
                                 p = (s - warmup_steps) / (max_steps - warmup_steps)
    s >= max_steps:              min_lr

so the first step already moves (``lr / warmup_steps``), the peak ``lr`` is
reached at ``s = warmup_steps - 1`` (and ``s = warmup_steps``), and the
schedule arrives at ``min_lr`` at ``max_steps``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: nn.Module | Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: ``{"params": 2-D+ weights, "weight_decay": weight_decay}`` and the rest with 0.

    ``model``: a module or ``named_parameters()`` pairs; frozen parameters
    (``requires_grad=False``) are left out. Each group has a ``"names"``
    list for inspection (ignored by the optimizer).
    """
    named = model.named_parameters() if isinstance(model, nn.Module) else model
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    seen: set[int] = set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [{"params": decay, "weight_decay": float(weight_decay), "names": decay_names},
            {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names}]


def build_optimizer(model: nn.Module, trainer: Any, **kwargs) -> torch.optim.Optimizer:
    """``trainer.optimizer`` from a ``trainer`` config node: AdamW (``lr``, ``weight_decay``, ``betas``,
    ``eps``) or SGD with momentum (``lr``, ``weight_decay``, ``momentum``), same parameter groups.

    With every parameter on CUDA the optimizer is ``fused`` (one kernel per step
    for all parameters; ``sbp_core.step_on_locals`` steps global parameters'
    CUDA locals with it). Extra ``kwargs`` go to the torch optimizer (e.g.
    ``foreach=False``) and override that.
    """
    params = list(model.parameters()) if isinstance(model, nn.Module) else [p for _, p in model]
    if params and all(p.device.type == "cuda" for p in params):
        kwargs = {"fused": True, **kwargs}
    kind = str(trainer.get("optimizer", "adamw"))
    if kind == "sgd":
        return torch.optim.SGD(param_groups(model, trainer.weight_decay), lr=float(trainer.lr),
                               momentum=float(trainer.momentum), **kwargs)
    if kind != "adamw":
        raise ValueError(f"trainer.optimizer={kind!r}: unknown; valid: adamw, sgd")
    betas = tuple(float(b) for b in trainer.betas)
    if len(betas) != 2:
        raise ValueError(f"trainer.betas={list(betas)}: must be two numbers, e.g. [0.9, 0.95]")
    return torch.optim.AdamW(param_groups(model, trainer.weight_decay), lr=float(trainer.lr), betas=betas,
                             eps=float(trainer.eps), **kwargs)


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based); see the module docstring."""
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr={min_lr!r}: must be in [0, lr={lr!r}]")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: must be >= 0 (a warmup longer than max_steps "
                         "leaves the run in warmup)")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, trainer: Any, last_step: int = -1) -> LambdaLR:
    """``LambdaLR`` following :func:`lr_at` with ``trainer.lr``/``min_lr``/``warmup_steps``/``max_steps``.

    The multiplier is ``lr_at(s) / trainer.lr`` on every group (their
    ``initial_lr`` must be ``trainer.lr``, as :func:`build_optimizer` sets).
    ``last_step``: when resuming without the scheduler's state dict, the
    index of the last step taken (``steps_done - 1``); the optimizer then has
    the learning rate of step ``last_step + 1``. Loading the scheduler's state
    dict restores the same thing.
    """
    lr, min_lr = float(trainer.lr), float(trainer.min_lr)
    warmup, total = int(trainer.warmup_steps), int(trainer.max_steps)
    if not lr > 0:
        raise ValueError(f"trainer.lr={lr!r}: must be > 0")
    lr_at(0, lr, min_lr, warmup, total)  # validates the arguments now, not at the first step

    def multiplier(step: int) -> float:
        return lr_at(step, lr, min_lr, warmup, total) / lr

    if last_step >= 0:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", lr)
    return LambdaLR(optimizer, multiplier, last_epoch=last_step)


# The hyper-parameters a config sets. Not the kernel flags (``fused``: ``load_optimizer_state_dict`` keeps the
# current optimizer's) nor a state format (LazyAdamW's ``dense_state``: the loaded state has its form).
HYPER_PARAMETERS = ("initial_lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov")


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's hyper-parameters as built from the config (``HYPER_PARAMETERS``: the
    schedule's peak ``initial_lr``, weight decay, betas, eps, momentum, ...)."""
    return [{k: g[k] for k in HYPER_PARAMETERS if k in g} for g in optimizer.param_groups]


def follow_config(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, built: list[dict]) -> list[tuple]:
    """After a checkpoint's optimizer and scheduler state were loaded: the config's hyper-parameters again
    (``built``: :func:`settings` before loading), and the learning rate of the step the scheduler is at
    from the config's schedule.

    A checkpoint's state dicts carry the saved run's hyper-parameters, and a ``LambdaLR`` its ``base_lrs``;
    left so, a run resumed with another ``trainer.lr`` or ``max_steps`` would apply the old schedule while
    logging the new one (the trainer logs ``lr_at`` of the config). As Megatron's
    ``--override-opt_param-scheduler``, the config wins; with an unchanged config nothing changes. Returns
    ``(setting, saved, now)`` for each setting that changed.
    """
    changed = {}
    for group, mine in zip(optimizer.param_groups, built):
        for k, v in mine.items():
            if group.get(k) != v:
                changed.setdefault(k, (group.get(k), v))
            group[k] = v
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, base, at in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * at(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reads
    return [(k, a, b) for k, (a, b) in changed.items()]
