"""Verification pairs in InsightFace's ``.bin`` format (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin``, ...).

A ``.bin`` is a pickle of ``(bins, issame_list)``: ``bins`` holds ``2 * P``
encoded images (bytes, or uint8 numpy arrays of the bytes), pair ``i`` being
images ``2i`` and ``2i + 1``; ``issame_list`` holds ``P`` booleans. Files
written by Python 2 need ``encoding="bytes"``.

Reading uses a restricted unpickler: only the builtin containers and numpy's
array reconstruction are allowed, so a crafted file cannot run code.
"""
from __future__ import annotations

import pickle

import torch

from .images import decode_image, encode_image

_ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "bytes"), ("builtins", "bytearray"),
    ("builtins", "bool"), ("builtins", "int"), ("builtins", "str"), ("_codecs", "encode"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"a pairs .bin may hold only images and booleans, not {module}.{name}")
        return super().find_class(module, name)


def write_pairs(path: str, images: list, issame: list) -> None:
    """``images``: ``2 * len(issame)`` uint8 ``[3, H, W]`` tensors, encoded as JPEG."""
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(issame)} pairs need {2 * len(issame)} images, got {len(images)}")
    with open(path, "wb") as f:
        pickle.dump(([encode_image(im) for im in images], [bool(s) for s in issame]), f, protocol=4)


def read_pairs(path: str, image_size: int) -> tuple:
    """``(uint8 [2P, 3, S, S] images, bool [P] issame)`` from a ``.bin``; errors name the file and the image."""
    with open(path, "rb") as f:
        try:
            bins, issame = _Restricted(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a pairs .bin (a pickle of (images, issame_list)): {e}") from None
    if len(bins) != 2 * len(issame):
        raise ValueError(f"{path}: {len(issame)} pairs need {2 * len(issame)} images, the file has {len(bins)}")
    images = torch.stack([decode_image(bytes(b), image_size, f"{path}: image {i}") for i, b in enumerate(bins)])
    return images, torch.tensor([bool(s) for s in issame])
