"""InsightFace's training sets: a directory with ``train.rec``, ``train.idx`` and ``property``.

``property`` is one line ``num_classes,height,width``. Record 0, when its
header has ``flag > 0``, is the dataset header: its first label is one past
the last image record (images are records ``1 .. label[0] - 1``; identity
records may follow, as InsightFace's packer writes them); otherwise every
record in the index is an image. An image record's label is its header's
label (the first one when it has several).

Bad input is reported before training where it is cheap (missing files, a
``property`` that does not parse, an index pointing past the file) and
otherwise when the record is read, naming the file and the record: corrupt
or truncated records (``recordio.RecordIOError``), a label outside
``0 .. num_classes - 1``, image bytes that do not decode.
"""
from __future__ import annotations

import os

from .images import ImageSource
from .recordio import RecordIOError, RecordReader, unpack_image

FILES = ("train.rec", "train.idx", "property")


def read_property(root: str) -> tuple:
    """``(num_classes, height, width)`` from ``root/property``."""
    path = os.path.join(root, "property")
    try:
        with open(path) as f:
            fields = [int(v) for v in f.read().strip().split(",")]
        num_classes, height, width = fields
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: an InsightFace dataset directory holds {', '.join(FILES)}") from None
    except ValueError:
        raise ValueError(f"{path} must hold 'num_classes,height,width' (three integers)") from None
    if num_classes < 1:
        raise ValueError(f"{path} says {num_classes} classes; need at least 1")
    return num_classes, height, width


class FaceRecords(ImageSource):
    def __init__(self, root: str, image_size: int | None = None, flip: bool = True):
        self.root = root
        self.num_classes, height, _ = read_property(root)
        self.image_size = int(image_size or height)
        self.flip = flip
        self.reader = RecordReader(os.path.join(root, "train.rec"), os.path.join(root, "train.idx"))
        keys = self.reader.keys()
        header = self._header(keys)
        self.keys = list(range(1, header)) if header else keys
        missing = [k for k in self.keys[:1] + self.keys[-1:] if k not in self.reader.offsets]
        if missing:
            raise RecordIOError(f"{self.reader.idx_path}: the header record promises images 1..{header - 1} "
                                f"but record {missing[0]} is not indexed")
        self.n_images = len(self.keys)
        if self.n_images == 0:
            raise ValueError(f"{self.reader.rec_path} holds no image records")

    def _header(self, keys) -> int | None:
        if 0 not in keys:
            return None
        try:
            head, _ = unpack_image(self.reader.read(0))
        except ValueError as e:
            raise RecordIOError(f"{self.reader.rec_path}: record 0: {e}") from None
        return int(head.label[0]) if head.flag > 0 else None

    def _load(self, index: int) -> tuple:
        key = self.keys[index]
        return self.reader.read(key), None, f"{self.reader.rec_path}: record {key}"

    def _label(self, index: int, data: bytes, where: str) -> tuple:
        try:
            head, image = unpack_image(data)
        except ValueError as e:
            raise RecordIOError(f"{where}: {e}") from None
        label = head.label[0] if head.flag > 0 else head.label
        return int(label), image
