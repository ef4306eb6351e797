"""Stand-ins of Hugging Face weight files for validation tests: the headers of the real tensors, no data.

``write_headers(path, shapes)`` writes a ``model.safetensors`` whose header lists ``{name: shape}`` (float32)
and whose data is a hole (a sparse file): ``safe_open`` reads the header and the sizes it implies, as
validation does, without the bytes being written.
"""
from __future__ import annotations

import json
import math

import torch


def write_headers(path, shapes: dict) -> None:
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def hf_shapes(recipe, model_cfg) -> dict:
    """``{Hugging Face name: shape}`` of the model ``model_cfg`` describes: our names (GPT-2's and LLaMA's are
    Hugging Face's), a tied LM head left out, the embedding's rows unpadded."""
    with torch.device("meta"):
        model = recipe.build_model(model_cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied head is the embedding, named once
    for name in ("transformer.wte.weight", "model.embed_tokens.weight", "lm_head.weight"):
        if name in shapes:
            shapes[name] = (int(model_cfg.vocab_size), *shapes[name][1:])
    return shapes
