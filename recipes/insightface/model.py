"""The face-recognition model: a backbone that embeds images and the margin-softmax head, plain torch.

``FaceModel(backbone, head)(images, labels)`` is the training loss;
``embed(images)`` the embeddings verification compares. ``build(...)`` makes
one from the recipe's model config values; ``pipeline_plan(arch)`` is its
split into pipeline stages.
"""
from __future__ import annotations

from torch import nn

from .head import MarginSoftmaxHead
from . import iresnet as _iresnet
from . import mobilefacenet as _mobilefacenet
from .iresnet import DEPTHS, iresnet
from .margin import CombinedMargin
from .mobilefacenet import MobileFaceNet

ARCHS = tuple(DEPTHS) + ("mobilefacenet",)


class FaceModel(nn.Module):
    def __init__(self, backbone: nn.Module, head: MarginSoftmaxHead):
        super().__init__()
        self.backbone, self.head = backbone, head

    def embed(self, images):
        return self.backbone(images)

    def forward(self, images, labels=None):
        """The loss; on a pipeline stage without the head (``pipeline_plan``), the backbone's output."""
        x = self.backbone(images)
        return x if self.head is None else self.head(x, labels)


def build_backbone(arch: str, width: int, image_size: int, embedding_size: int, dropout: float = 0.0) -> nn.Module:
    if arch == "mobilefacenet":
        return MobileFaceNet(width, image_size, embedding_size)
    if arch in DEPTHS:
        return iresnet(arch, width=width, image_size=image_size, embedding_size=embedding_size, dropout=dropout)
    raise ValueError(f"model arch {arch!r} is unknown; valid: {', '.join(ARCHS)}")


def pipeline_plan(arch: str) -> dict:
    """The pipeline split of a ``FaceModel`` with backbone ``arch``: the backbone's blocks are the repeated
    layers, its stem the first stage's, its embedding and the margin-softmax head the last stage's."""
    plan = (_mobilefacenet if arch == "mobilefacenet" else _iresnet).pipeline("backbone")
    return {**plan, "last": [*plan["last"], "head"]}


def build(arch: str, width: int, image_size: int, embedding_size: int, num_classes: int, loss: str = "arcface",
          s: float = 64.0, margins=None, sample_rate: float = 1.0, dropout: float = 0.0,
          meta_head: bool = False) -> FaceModel:
    """``meta_head``: the class centres stay on the meta device, for ``distribute_module`` to build each rank's
    shard of them (``MarginSoftmaxHead.init_shard``)."""
    backbone = build_backbone(arch, width, image_size, embedding_size, dropout)
    head = MarginSoftmaxHead(num_classes, embedding_size, CombinedMargin.named(loss, s, margins), sample_rate,
                             meta=meta_head)
    return FaceModel(backbone, head)
