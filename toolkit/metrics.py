"""The run's metrics: ``metrics.jsonl``, one console line per logged step, and Weights & Biases.

:class:`MetricsLogger` is created on every rank and does nothing except on
rank 0 (``enabled``), so the trainer needs no rank checks. Each
:meth:`MetricsLogger.log` call appends one JSON object to
``<run_dir>/metrics.jsonl``, prints one line, and mirrors the values to W&B.

Row keys. Training rows: ``step``, ``loss``, ``lr``, ``grad_norm``, the
throughput (``throughput_key``: ``tokens_per_s``, ``images_per_s`` or
``samples_per_s`` by recipe), ``tflops``, ``mfu``, ``mem``; evaluation rows
(:meth:`log_eval`): ``step`` and the recipe's metrics (GPT-2's ``val_loss``
and ``val_ppl``). ``mem`` is filled in when not given: the
peak bytes of this process (``torch.cuda.max_memory_allocated`` on CUDA,
otherwise the peak resident set size from ``getrusage``). ``tflops`` and
``mfu`` are filled in from the throughput when the logger knows
``flops_per_item`` and ``peak_tflops`` (see :mod:`toolkit.flops`; ``mfu`` is
against ``peak_tflops * n_devices``, and left out, with a warning, where it
would exceed 100%: a peak below what the run achieves is a wrong peak). Values must be JSON numbers, strings,
booleans or ``None``; tensors are converted with ``.item()``. Non-finite
floats are written as ``null`` (strict JSON) and shown as ``nan``/``inf`` on the console.

W&B: ``cfg.logger.backend == "wandb"`` starts ``wandb.init(project, name,
entity, tags, config=<resolved cfg>, dir=run_dir, mode=...)`` with ``mode``
``cfg.logger.mode``, or when that is null ``online`` if ``WANDB_API_KEY`` is
set and ``offline`` otherwise; ``none`` never imports wandb. W&B's console
capture is off (the console lines are in ``metrics.jsonl`` already).
:meth:`close` finishes the W&B run; the logger is a context manager.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

from sbp_core.process_groups import world_rank

METRICS_FILE = "metrics.jsonl"


def peak_memory_bytes() -> int:
    """Peak memory of this process in bytes: CUDA allocator peak on CUDA, else peak RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def reset_peak_memory() -> None:
    """Start ``peak_memory_bytes`` afresh on CUDA (a process that trains several jobs, as a bench does,
    reports each one's peak); the peak RSS of a CPU process cannot be reset."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _this_rank() -> int:
    """This rank (``world_rank``); before the process group exists, the launcher's ``RANK`` says who logs."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return world_rank()
    return int(os.environ.get("RANK", "0"))


def wandb_mode(mode: Optional[str]) -> str:
    """The W&B mode for ``cfg.logger.mode``: itself, or ``online``/``offline`` by ``WANDB_API_KEY``."""
    if mode is not None:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not loggable; "
                    "valid: a number, string, bool, None or a one-element tensor")


def _format(row: dict) -> str:
    parts = [f"step {row['step']}"]
    fmt = {"loss": "loss {:.4f}", "val_loss": "val_loss {:.4f}", "val_ppl": "val_ppl {:.2f}",
           "lr": "lr {:.2e}", "grad_norm": "grad_norm {:.3f}", "tokens_per_s": "{:,.0f} tok/s",
           "images_per_s": "{:,.1f} img/s", "samples_per_s": "{:,.0f} samples/s",
           "tflops": "{:.3f} TFLOP/s", "mfu": "mfu {:.1%}"}
    for key, value in row.items():
        if key == "step" or value is None:
            continue
        if key == "mem":
            parts.append(f"mem {value / 2**20:,.0f} MiB")
        elif key in fmt and isinstance(value, (int, float)):
            parts.append(fmt[key].format(value))
        else:
            parts.append(f"{key} {value}")
    return " | ".join(parts)


class MetricsLogger:
    """Rank 0's record of a run (see module docstring for the row contract).

    ``cfg``: the job config (a DictConfig or dict with a ``logger`` node);
    ``enabled``: whether this process writes anything (default: rank 0).
    ``flops_per_item`` (per unit of ``throughput_key``), ``peak_tflops``,
    ``n_devices``: for ``tflops``/``mfu``.
    """

    def __init__(self, run_dir: str | Path, cfg: Any, enabled: Optional[bool] = None, *,
                 flops_per_item: Optional[float] = None, peak_tflops: Optional[float] = None,
                 n_devices: int = 1, console: bool = True, throughput_key: str = "tokens_per_s"):
        self.enabled = _this_rank() == 0 if enabled is None else bool(enabled)
        self.run_dir = Path(run_dir)
        self.flops_per_item = flops_per_item
        self.throughput_key = throughput_key
        self.peak_tflops = peak_tflops
        self.n_devices = n_devices
        self.console = console
        self._warned_mfu = False
        self.path = self.run_dir / METRICS_FILE
        self.wandb_run = None
        self._file = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        logger = _node(cfg, "logger")
        backend = _node(logger, "backend", "none") if logger is not None else "none"
        if backend == "wandb":
            self.wandb_run = self._start_wandb(cfg, logger)
        elif backend != "none":
            raise ValueError(f"logger.backend={backend!r}: unknown; valid: wandb, none")

    def _start_wandb(self, cfg: Any, logger: Any):
        import wandb
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
        name = _node(logger, "name")
        if name is None:
            from toolkit.config.parallel_name import parallel_name

            model, par = config.get("model", {}), config.get("parallel", {})
            name = f"{model.get('name', 'model')}_" + parallel_name(
                par.get("dp", 1), par.get("tp", 1), par.get("pp", 1), par.get("zero", 0), par.get("cp", 1))
        tags = _node(logger, "tags") or []
        return wandb.init(project=_node(logger, "project", "sbp-recipes"), name=name,
                          entity=_node(logger, "entity"), tags=list(tags), config=config,
                          dir=str(self.run_dir), mode=wandb_mode(_node(logger, "mode")),
                          reinit="create_new", settings=wandb.Settings(console="off"))

    def log(self, step: int, **metrics: Any) -> Optional[dict]:
        """Record a training row for ``step``; returns the row written (``None`` when disabled)."""
        if not self.enabled:
            return None
        row = {"step": int(step)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        rate = row.get(self.throughput_key)
        if rate is not None and self.flops_per_item is not None:
            from toolkit import flops

            row.setdefault("tflops", flops.tflops(rate, self.flops_per_item))
            if self.peak_tflops and "mfu" not in row:
                row["mfu"] = self._mfu(flops.mfu(rate, self.flops_per_item, self.peak_tflops, self.n_devices))
        if "mem" not in row:
            row["mem"] = peak_memory_bytes()
        self._write(row)
        return row

    def _mfu(self, value: float) -> Optional[float]:
        """``value``, or ``None`` (with a warning, once) above 100%: then the peak, not the run, is wrong."""
        if value <= 1.0:
            return value
        if not self._warned_mfu:
            self._warned_mfu = True
            print(f"warning: MFU would read {value:.0%} against a peak of {self.peak_tflops:g} TFLOP/s per device, "
                  "so that peak is too low for this device and precision; MFU is left out. "
                  "Set trainer.peak_tflops to the device's dense peak.", flush=True)
        return None

    def log_eval(self, step: int, **metrics: Any) -> Optional[dict]:
        """Record an evaluation row of ``metrics`` (what the recipe's ``evaluate`` returned)."""
        if not self.enabled:
            return None
        row = {"step": int(step), **{key: _plain(value) for key, value in metrics.items()}}
        self._write(row)
        return row

    def _write(self, row: dict) -> None:
        # Strict JSON: NaN and infinities become null in the file (the console shows them).
        safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self._file.write(json.dumps(safe, allow_nan=False) + "\n")
        self._file.flush()
        if self.console:
            print(_format(row), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in safe.items() if k != "step" and v is not None},
                               step=row["step"])

    def close(self) -> None:
        """Flush and close ``metrics.jsonl`` and finish the W&B run (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _node(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a DictConfig or a dict, ``default`` when absent or null."""
    if cfg is None:
        return default
    value = cfg.get(key, default)
    return default if value is None else value


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of ``<run_dir>/metrics.jsonl`` in order (for tests, plots and resume checks)."""
    with open(Path(run_dir) / METRICS_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
