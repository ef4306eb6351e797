"""Optional GPU image decoding with NVIDIA DALI (``data.decoder=dali``, or ``auto`` when it is usable).

Used only when ``nvidia.dali`` imports and CUDA has a device; otherwise
``available()`` is ``False`` and the PIL decoder runs (``data.decoder=dali``
is then refused before any process starts, with the reason).

``decode(payloads, size, device)``: JPEG/PNG bytes -> ``uint8 [b, 3, size, size]``
on ``device``: DALI's ``external_source`` feeds the encoded bytes, the
``mixed`` image decoder (nvJPEG) decodes on the GPU, ``resize`` and a
``transpose`` to CHW follow; the batch leaves DALI through DLPack. One DALI
pipeline per (process, device, size, batch capacity), built on first use.
A pipeline serves one batch at a time: the read-ahead's worker threads
decode in turn on it, each batch copied out of DALI's buffers on the
process's host-to-device copy stream (``copy_stream``: the copy waits for no
compute), and the copy finished before the next run may overwrite them.
"""
from __future__ import annotations

import importlib.util
import threading

import torch

from runtime.data_pipeline import copy_stream
from sbp_core.boxing.collectives import block_until_done

_PIPES: dict = {}  # key -> (pipeline, its lock)
_BUILD = threading.Lock()


def why_unavailable() -> str | None:
    """Why DALI cannot decode here (``None``: it can)."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return "nvidia.dali is not installed (pip install nvidia-dali-cuda120)"
    if not torch.cuda.is_available():
        return "DALI decodes on a GPU and CUDA has no device here"
    return None


def available() -> bool:
    return why_unavailable() is None


def _pipeline(size: int, capacity: int, device_id: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=capacity, num_threads=2, device_id=device_id, prefetch_queue_depth=1)
    def pipe():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        images = fn.decoders.image(encoded, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=size, resize_y=size)
        return fn.transpose(images, perm=[2, 0, 1])

    p = pipe()
    p.build()
    return p


def decode(payloads: list, size: int, device) -> torch.Tensor:
    import numpy as np

    device = torch.device(device)
    device_id = device.index if device.index is not None else torch.cuda.current_device()
    capacity = max(1, 1 << (len(payloads) - 1).bit_length())
    key = (device_id, size, capacity)
    with _BUILD:
        if key not in _PIPES:
            _PIPES[key] = (_pipeline(size, capacity, device_id), threading.Lock())
    pipe, lock = _PIPES[key]
    device = torch.device("cuda", device_id)
    stream = copy_stream(device)  # not the compute stream: the copy must not wait behind the step's kernels
    with lock:
        pipe.feed_input("encoded", [np.frombuffer(p, dtype=np.uint8) for p in payloads])
        (out,) = pipe.run()
        with torch.cuda.stream(stream):
            batch = torch.utils.dlpack.from_dlpack(out.as_tensor()).clone()
        block_until_done(stream)  # the copy has read DALI's buffer before its next run
    batch.record_stream(torch.cuda.default_stream(device))  # where the step reads it
    return batch
