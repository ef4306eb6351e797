"""Image bytes <-> tensors, and the training-image sources' shared sampling interface.

``decode_image(data, size)`` is a ``uint8 [3, size, size]`` tensor (PIL
decodes JPEG/PNG/BMP; other sizes are resized bilinearly); ``normalize``
maps a ``uint8`` batch to ``float32`` in ``[-1, 1]`` (InsightFace's
``(x / 255 - 0.5) / 0.5``).

``ImageSource`` is what ``toolkit.data.MicroBatches`` samples from: row
``r < n`` is image ``r``, row ``n + r`` (when ``flip``) is image ``r``
mirrored left-right, so the sampler's shuffle draws InsightFace's random
horizontal flip deterministically from the run seed (and a resumed run
sees the same flips). ``read(rows)`` does the file I/O, ``decode(raw)`` the
image decoding (on the runtime's data queue), ``collate(samples)`` stacks
``{"image": float32 [b, 3, H, W], "label": int64 [b]}``. A source whose
``gpu_decoder`` is set (``dali.decode`` bound to a device) decodes a whole
micro-batch on the GPU instead of one image at a time with PIL.
"""
from __future__ import annotations

import io
from abc import ABC, abstractmethod

import torch


class ImageDecodeError(ValueError):
    """Image bytes that no decoder understands; the message names where they came from."""


def decode_image(data: bytes, size: int, where: str = "image") -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im = im.convert("RGB")
            if im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            raw = im.tobytes()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageDecodeError(f"{where}: cannot decode its image ({len(data)} bytes): {e}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1).contiguous()


def encode_image(image: torch.Tensor, fmt: str = "JPEG", quality: int = 95) -> bytes:
    """``uint8 [3, H, W]`` as JPEG (or PNG) bytes."""
    from PIL import Image

    arr = image.permute(1, 2, 0).contiguous().numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def normalize(images: torch.Tensor) -> torch.Tensor:
    return images.float().div_(127.5).sub_(1.0)


class ImageSource(ABC):
    """Base of the training sources: subclasses set ``n_images``, ``num_classes``, ``image_size`` and ``_load``.

    ``_load(index) -> (bytes, label or None, where)`` reads image ``index``
    (``label`` ``None``: known only once decoded, e.g. from a record
    header, then ``_label(index, payload)`` gives it).
    """

    n_images: int
    num_classes: int
    image_size: int
    flip: bool = True
    gpu_decoder = None  # ``(payloads, size) -> uint8 [b, 3, size, size]`` on a GPU (DALI), else PIL per image

    def __len__(self) -> int:
        return self.n_images * (2 if self.flip else 1)

    def read(self, rows: torch.Tensor) -> list:
        out = []
        for r in rows.tolist():
            if not 0 <= r < len(self):
                raise IndexError(f"row {r} is outside this source's {len(self)} rows")
            index, mirrored = r % self.n_images, r >= self.n_images
            out.append((index, mirrored) + tuple(self._load(index)))
        return out

    def decode(self, raw: list) -> list:
        labelled = []
        for index, mirrored, data, label, where in raw:
            if label is None:
                label, data = self._label(index, data, where)
            if not 0 <= label < self.num_classes:
                raise ValueError(f"{where} has label {label}, outside 0..{self.num_classes - 1} "
                                 f"({self.num_classes} classes)")
            labelled.append((mirrored, data, label, where))
        if self.gpu_decoder is not None and labelled:
            images = self.gpu_decoder([x[1] for x in labelled], self.image_size)
        else:
            images = [decode_image(data, self.image_size, where) for _, data, _, where in labelled]
        return [(im.flip(-1) if mirrored else im, label) for im, (mirrored, _, label, _) in zip(images, labelled)]

    def collate(self, samples: list) -> dict:
        s = self.image_size
        images = torch.stack([x[0] for x in samples]) if samples else torch.empty(0, 3, s, s, dtype=torch.uint8)
        return {"image": normalize(images), "label": torch.tensor([x[1] for x in samples], dtype=torch.int64)}

    @abstractmethod
    def _load(self, index: int) -> tuple:
        """``(bytes, label or None, where)`` of image ``index``."""

    def _label(self, index: int, data: bytes, where: str) -> tuple:
        raise TypeError(f"{type(self).__name__}._load gave no label for image {index} ({where}) "
                        f"and the source defines no _label to read it from the payload")
