"""One device's dense peak TFLOP/s for a run's precision: the denominator of MFU.

In order of precedence:

1. ``trainer.peak_tflops``, when set;
2. on CUDA, the vendor's dense (no structured sparsity) tensor-core peak for
   the precision, from a table matched against ``torch.cuda.get_device_name()``;
3. on CUDA, a device the table lacks (or a precision it lacks, bf16 on a
   V100): the best of a few ``8192^3`` matmuls measured on that device in
   that dtype (``flops.measured_peak_tflops``);
4. on CPU: an fp32 ``1024^3`` matmul measured with this process's threads,
   whatever the precision (a CPU has no separate low-precision peak worth
   the name, and this is what CPU runs always used).

fp32 on CUDA counts as TF32 when torch lets matmuls use it
(``torch.get_float32_matmul_precision()`` is not ``"highest"``), else as
plain fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from toolkit import flops

# (substring of the device name, {precision: dense peak TFLOP/s}); the first match wins, so a
# more specific name comes before a name it contains ("H100 PCIe" before "H100", "A100" before "A10").
DENSE_PEAKS = (
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
)

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Peak(NamedTuple):
    tflops: float
    source: str  # where the figure came from, for the log


def cuda_precision(precision: str) -> str:
    """The table's precision for a run's ``trainer.precision`` on CUDA (fp32 is TF32 when torch allows it)."""
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return precision


def table_peak(device_name: str, precision: str) -> float | None:
    """The dense peak of ``precision`` for a device named ``device_name``, or ``None`` when not listed."""
    for key, peaks in DENSE_PEAKS:
        if key in device_name:
            return peaks.get(precision)
    return None


def device_peak(device_type: str, precision: str, override: float | None = None) -> Peak:
    """One device's peak for MFU (see the module docstring for the order)."""
    if override:
        return Peak(float(override), "trainer.peak_tflops")
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        prec = cuda_precision(precision)
        listed = table_peak(name, prec)
        if listed is not None:
            return Peak(listed, f"{name} {prec} dense peak (datasheet)")
        measured = flops.measured_peak_tflops(_DTYPES[prec], f"cuda:{torch.cuda.current_device()}")
        return Peak(measured, f"{name} {prec} matmul, measured")
    return Peak(flops.measured_peak_tflops(), "cpu fp32 matmul, measured")
