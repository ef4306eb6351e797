"""Synthetic identities written as an InsightFace dataset, so the recipe runs on a fresh machine offline.

Each identity is a *prototype* image: a greyish background with a random
tint plus ``blobs`` coloured Gaussian blobs at random places and widths. Each of its
images is the prototype with every blob moved by up to ``jitter`` of the
image, a random shift of up to 1/16 of the image, brightness and contrast
changes and pixel noise. Images are JPEG-encoded into ``train.rec`` /
``train.idx`` (header record 0, one image record per image, one record per
identity listing its images, as InsightFace's packer writes) with a
``property`` file; ``val.bin`` holds verification pairs (half same identity,
half not) drawn from identities that are *not* in the training set, the way
LFW's people are not in MS1M. Everything follows from ``seed``.

``ensure(spec, cache_dir)`` builds the directory once (``toolkit.data.build_once``)
and returns its path.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from toolkit.data.build_once import build_once, content_key

from .face_records import FILES
from .images import encode_image
from .pairs import write_pairs
from .recordio import RecordWriter, pack_image

VERSION = 1  # bump when the generator's output changes, so caches rebuild


@dataclass(frozen=True)
class SyntheticSpec:
    identities: int = 200
    images_per_identity: int = 16
    image_size: int = 32
    val_identities: int = 100
    val_pairs: int = 600
    blobs: int = 6
    jitter: float = 0.06
    noise: float = 0.06
    seed: int = 0

    def check(self) -> None:
        for name in ("identities", "images_per_identity", "image_size", "val_identities", "val_pairs", "blobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic data: {name} must be >= 1, got {getattr(self, name)}")
        if self.images_per_identity < 2 or self.val_identities < 2:
            raise ValueError("synthetic data: same- and different-identity pairs need images_per_identity >= 2 "
                             "and val_identities >= 2")


def _identity(g: torch.Generator, blobs: int) -> dict:
    return {"bg": 0.35 + 0.15 * torch.rand(3, 1, 1, generator=g),
            "centre": 0.15 + 0.7 * torch.rand(blobs, 2, generator=g),
            "width": 0.05 + 0.12 * torch.rand(blobs, generator=g), "colour": torch.rand(blobs, 3, generator=g),
            "weight": 0.25 + 0.35 * torch.rand(blobs, generator=g)}


def _render(ident: dict, spec: SyntheticSpec, g: torch.Generator, m: int) -> torch.Tensor:
    """``m`` augmented images of ``ident``: ``uint8 [m, 3, S, S]``."""
    s, k = spec.image_size, ident["centre"].shape[0]
    axis = (torch.arange(s, dtype=torch.float32) + 0.5) / s
    shift = (torch.rand(m, 1, 2, generator=g) - 0.5) * (2 / 16)
    centre = ident["centre"] + spec.jitter * torch.randn(m, k, 2, generator=g) + shift  # [m, k, 2]
    dy = axis[None, None, :, None] - centre[..., 0, None, None]
    dx = axis[None, None, None, :] - centre[..., 1, None, None]
    bumps = torch.exp(-(dx ** 2 + dy ** 2) / (2 * ident["width"][:, None, None] ** 2)) * ident["weight"][:, None, None]
    image = ident["bg"] + torch.einsum("kc,mkyx->mcyx", ident["colour"], bumps)  # [m, 3, s, s]
    mean = image.mean((1, 2, 3), keepdim=True)
    contrast = 0.8 + 0.4 * torch.rand(m, 1, 1, 1, generator=g)
    brightness = 0.15 * (torch.rand(m, 1, 1, 1, generator=g) - 0.5)
    image = (image - mean) * contrast + mean + brightness + spec.noise * torch.randn(image.shape, generator=g)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def write_dataset(root: str, spec: SyntheticSpec) -> None:
    """``train.rec``, ``train.idx``, ``property`` and ``val.bin`` for ``spec`` in ``root``."""
    spec.check()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend (100x slower on a busy machine)
    try:
        _write(root, spec)
    finally:
        torch.set_num_threads(threads)


def _write(root: str, spec: SyntheticSpec) -> None:
    g = torch.Generator().manual_seed(spec.seed)
    n = spec.identities * spec.images_per_identity
    with RecordWriter(os.path.join(root, "train.rec"), os.path.join(root, "train.idx")) as w:
        w.write(0, pack_image((n + 1, n + 1 + spec.identities), b""))
        key = 1
        for label in range(spec.identities):
            for image in _render(_identity(g, spec.blobs), spec, g, spec.images_per_identity):
                w.write(key, pack_image(label, encode_image(image), id=key))
                key += 1
        for label in range(spec.identities):
            start = 1 + label * spec.images_per_identity
            w.write(key, pack_image((start, start + spec.images_per_identity), b""))
            key += 1
    with open(os.path.join(root, "property"), "w") as f:
        f.write(f"{spec.identities},{spec.image_size},{spec.image_size}\n")
    _write_pairs(os.path.join(root, "val.bin"), spec, torch.Generator().manual_seed(spec.seed + 1))


def _write_pairs(path: str, spec: SyntheticSpec, g: torch.Generator) -> None:
    people = [_identity(g, spec.blobs) for _ in range(spec.val_identities)]
    images, issame = [], []
    for i in range(spec.val_pairs):
        same = i % 2 == 0
        a = int(torch.randint(spec.val_identities, (), generator=g))
        b = a if same else (a + 1 + int(torch.randint(spec.val_identities - 1, (), generator=g))) % spec.val_identities
        images += [_render(people[a], spec, g, 1)[0], _render(people[b], spec, g, 1)[0]]
        issame.append(same)
    write_pairs(path, images, issame)


def ensure(spec: SyntheticSpec, cache_dir: str) -> str:
    """The dataset directory for ``spec`` under ``cache_dir``, generated on first use."""
    spec.check()
    root = os.path.join(os.path.expanduser(cache_dir), "insightface",
                        f"synthetic-{content_key({**asdict(spec), 'version': VERSION})}")
    build_once(root, lambda tmp: write_dataset(tmp, spec))
    missing = [f for f in FILES + ("val.bin",) if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise FileNotFoundError(f"{root} lacks {missing}: remove the directory so it is generated again")
    return root
