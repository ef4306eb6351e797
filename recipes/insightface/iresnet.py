"""iResNet face backbones (Duta et al., "Improved Residual Networks"; InsightFace's r18/r50), plain torch.

``IResNet(layers, width, image_size, embedding_size)`` maps ``[N, 3, H, H]``
images (``H = image_size``, a multiple of 16) to ``[N, embedding_size]``
embeddings:

- stem: 3x3 conv (stride 1) -> BN -> PReLU;
- four stages of pre-activation basic blocks, ``width * (1, 2, 4, 8)``
  channels, each stage opening with a stride-2 block; a block is
  BN -> 3x3 conv -> BN -> PReLU -> 3x3 conv (the stride) -> BN, plus the
  identity (a 1x1 strided conv + BN where the shape changes);
- BN over the last feature map, dropout, flatten, a linear map of
  ``8 * width * (H / 16) ** 2`` features to the embedding, and a BatchNorm1d
  with its scale fixed at 1 (not trained), as InsightFace does.

``width=64, image_size=112`` is InsightFace's network; smaller widths and
images give the same topology at a cost a CPU can train. No distributed code:
the recipe's plan lays it out (parameters ``B``, batch ``S(0)``), and batch
norm's statistics are then computed over the global batch (sbp_core's
batch-norm rule), as one device would.
"""
from __future__ import annotations

from torch import nn

DEPTHS = {"iresnet18": (2, 2, 2, 2), "iresnet34": (3, 4, 6, 3), "iresnet50": (3, 4, 14, 3),
          "iresnet100": (3, 13, 30, 3)}
BN_EPS = 1e-5


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """Pre-activation residual block without a final non-linearity."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=BN_EPS)
        self.conv1 = _conv3x3(cin, cout)
        self.bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.prelu = nn.PReLU(cout)
        self.conv2 = _conv3x3(cout, cout, stride)
        self.bn3 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout, eps=BN_EPS))

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + (x if self.downsample is None else self.downsample(x))


class IResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), width: int = 64, image_size: int = 112, embedding_size: int = 512,
                 dropout: float = 0.0):
        super().__init__()
        if image_size % 16:
            raise ValueError(f"image_size {image_size} must be a multiple of 16 (four stride-2 stages)")
        self.conv1 = _conv3x3(3, width)
        self.bn1 = nn.BatchNorm2d(width, eps=BN_EPS)
        self.prelu = nn.PReLU(width)
        blocks, cin = [], width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            blocks.append(nn.Sequential(*[IBasicBlock(cin if j == 0 else cout, cout, 2 if j == 0 else 1)
                                          for j in range(n)]))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = blocks
        self.bn2 = nn.BatchNorm2d(cin, eps=BN_EPS)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin * (image_size // 16) ** 2, embedding_size)
        self.features = nn.BatchNorm1d(embedding_size, eps=BN_EPS)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0, 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def forward(self, x):
        # A pipeline stage holds some of the modules (``PIPELINE``); the others are None and skipped.
        if self.conv1 is not None:
            x = self.prelu(self.bn1(self.conv1(x)))
        for block in (b for layer in (self.layer1, self.layer2, self.layer3, self.layer4) for b in layer):
            if block is not None:
                x = block(x)
        if self.fc is None:
            return x
        x = self.dropout(self.bn2(x).flatten(1))
        return self.features(self.fc(x))


# The pipeline split (``toolkit.stages``) of an IResNet at ``backbone`` (a path prefix): its blocks are the
# repeated layers; the stem runs on the first stage, the embedding on the last.
def pipeline(backbone: str) -> dict:
    return {"layers": [f"{backbone}.layer{i}" for i in range(1, 5)],
            "first": [f"{backbone}.{m}" for m in ("conv1", "bn1", "prelu")],
            "last": [f"{backbone}.{m}" for m in ("bn2", "dropout", "fc", "features")]}


def iresnet(name: str, **kwargs) -> IResNet:
    """``iresnet18`` / ``iresnet34`` / ``iresnet50`` / ``iresnet100``."""
    if name not in DEPTHS:
        raise ValueError(f"iresnet {name!r} is unknown; valid: {', '.join(DEPTHS)}")
    return IResNet(DEPTHS[name], **kwargs)
