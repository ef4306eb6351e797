"""An image-folder training set: ``root/<identity>/<image>``, one sub-directory per class.

Classes are the sub-directory names in sorted order (labels ``0..C-1``);
images are the files with an image suffix inside each, sorted. Decoding and
flipping are ``images.ImageSource``'s.
"""
from __future__ import annotations

import os

from .images import ImageSource

SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


class ImageFolder(ImageSource):
    def __init__(self, root: str, image_size: int, flip: bool = True):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"image folder {root} does not exist")
        self.root, self.image_size, self.flip = root, int(image_size), flip
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.files, self.labels = [], []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            for f in sorted(os.listdir(folder)):
                if f.lower().endswith(SUFFIXES):
                    self.files.append(os.path.join(folder, f))
                    self.labels.append(label)
        self.num_classes, self.n_images = len(self.classes), len(self.files)
        if not self.n_images:
            raise ValueError(f"image folder {root} has no images ({', '.join(SUFFIXES)}) in class sub-directories")

    def _load(self, index: int) -> tuple:
        path = self.files[index]
        with open(path, "rb") as f:
            return f.read(), self.labels[index], path
