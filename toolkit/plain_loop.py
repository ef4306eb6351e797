"""A recipe trained by a plain PyTorch loop on one device: the reference our trainer is checked and timed against.

``PlainLoop(cfg, recipe, device)`` builds what ``toolkit.trainer.Job`` builds
for one device, without sbp_core or the runtime: the recipe's model class
from the same seed (so the same initial weights; meta parameters and buffers built whole
from their module's ``init_shard``, as ``distribute_module`` builds them
shard by shard), its optimizer (``fused`` on CUDA where torch has it, as the
trainer's) and LR schedule, autocast for ``trainer.precision`` (fp16 with
``torch.amp.GradScaler``), global-norm clipping, and the same batches
(``MicroBatches.load``: the rows the trainer's data pipeline reads).
``step(i)`` runs optimizer step ``i`` over its micro-batches and returns
the mean loss as a 0-d tensor on the device (no host synchronisation).

``preload``: the steps whose batches are copied to the device up front, so a
timed loop has its data already there (the plain loop of a benchmark).
``compile``: ``torch.compile`` the model.
"""
from __future__ import annotations

import torch

from sbp_core.module import init_shard_of
from toolkit.config.schema import typed
from toolkit.config.validate import validate
from toolkit.optim import build_scheduler


def materialized(model):
    """``model`` with every meta parameter and buffer built whole by the ``init_shard`` that
    ``distribute_module`` asks (a tied parameter stays one)."""
    done: dict = {}

    def whole(mod_name, attr, meta):
        init, name = init_shard_of(model, f"{mod_name}.{attr}" if mod_name else attr)
        return init(name, tuple((0, n) for n in meta.shape))

    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in done:
                    done[id(param)] = torch.nn.Parameter(whole(mod_name, attr, param), param.requires_grad)
                setattr(module, attr, done[id(param)])
        for attr, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                module._buffers[attr] = whole(mod_name, attr, buf)
    return model


class PlainLoop:
    def __init__(self, cfg, recipe, device, preload: int = 0, compile: bool = False):
        from runtime.data_pipeline import to_device
        from toolkit.trainer import AUTOCAST

        self.layout = lay = validate(cfg, recipe, world_size=1)
        self.cfg = cfg = typed(cfg, recipe)
        self.recipe, self.device = recipe, torch.device(device)
        tr = cfg.trainer
        self.batches = recipe.data(cfg, recipe.prepare(cfg), "train", 0, 1, lay)
        torch.manual_seed(int(tr.seed))  # as the trainer seeds right before it builds the model
        self.model = materialized(recipe.build_model(cfg.model)).to(self.device)
        self.model.train()
        if tr.activation_checkpointing:  # as the trainer does: each layer recomputed in backward
            recipe.checkpoint_layers(self.model, cfg.model)
        self.forward = torch.compile(self.model) if compile else self.model
        self.optimizer = recipe.build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, tr)
        self.dtype = AUTOCAST.get(str(tr.precision))
        self.scaler = torch.amp.GradScaler(self.device.type) if tr.precision == "fp16" else None
        self.clip = float(tr.grad_clip) if tr.grad_clip else None
        self.loaded = [[to_device(self.batches.load(i, k), self.device) for k in range(lay.accumulation)]
                       for i in range(preload)]

    def micro_batch(self, step: int, k: int) -> dict:
        """Micro-batch ``k`` of step ``step`` on the device: preloaded, else loaded now (a subclass may feed
        it from elsewhere: ``scripts/bench_data_feed.py`` feeds it from loaders)."""
        from runtime.data_pipeline import to_device

        if step < len(self.loaded):
            return self.loaded[step][k]
        return to_device(self.batches.load(step, k), self.device)

    def step(self, i: int) -> torch.Tensor:
        m = self.layout.accumulation
        total = torch.zeros((), device=self.device)
        for k in range(m):
            batch = self.micro_batch(i, k)
            x = {f: batch[f] for f in self.recipe.inputs}
            labels = {f: batch[f] for f in self.recipe.labels}
            with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                loss = self.recipe.stage_forward(self.forward, x, labels).float()
            scaled = loss / m if self.scaler is None else self.scaler.scale(loss / m)
            scaled.backward()
            total += loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / m
