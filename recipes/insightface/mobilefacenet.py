"""MobileFaceNet (Chen et al. 2018; InsightFace's ``mbf``), plain torch.

``MobileFaceNet(width, image_size, embedding_size, blocks)`` maps
``[N, 3, H, H]`` images (``H`` a multiple of 16) to ``[N, embedding_size]``:

- a stride-2 3x3 conv block (conv -> BN -> PReLU) to ``width`` channels and a
  3x3 depthwise conv block (or residual depthwise blocks when
  ``blocks[0] > 1``);
- three stride-2 bottlenecks (1x1 expand -> 3x3 depthwise -> 1x1 linear
  projection), each followed by ``blocks[i]`` residual bottlenecks: output
  widths ``width, 2*width, 2*width``; expanded (depthwise) widths ``width``
  in stage 1, ``2*width`` in stage 2 and in stage 3's residual blocks,
  ``4*width`` in stage 3's stride-2 block;
- a 1x1 conv block to 512 channels, then the global depthwise conv (GDC):
  an ``H/16 x H/16`` depthwise conv (linear), flatten, a bias-free linear map
  to the embedding and BatchNorm1d.

``width=128`` (InsightFace's ``scale=2``), ``image_size=112`` is InsightFace's
network. No distributed code; see ``iresnet.py`` for how the plan lays it out.
"""
from __future__ import annotations

from torch import nn

GDC_CHANNELS = 512


class ConvBlock(nn.Sequential):
    """conv -> BN (-> PReLU unless ``linear``)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, linear: bool = False,
                 padding: int = 0):
        layers = [nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        super().__init__(*layers, *([] if linear else [nn.PReLU(cout)]))


class Bottleneck(nn.Module):
    """1x1 expand to ``hidden`` -> 3x3 depthwise (``stride``) -> 1x1 linear to ``cout``; residual if asked."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int = 1, residual: bool = False):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(ConvBlock(cin, hidden), ConvBlock(hidden, hidden, 3, stride, groups=hidden, padding=1),
                                    ConvBlock(hidden, cout, linear=True))

    def forward(self, x):
        y = self.layers(x)
        return x + y if self.residual else y


class MobileFaceNet(nn.Module):
    def __init__(self, width: int = 128, image_size: int = 112, embedding_size: int = 512, blocks=(1, 4, 6, 2)):
        super().__init__()
        if image_size % 16:
            raise ValueError(f"image_size {image_size} must be a multiple of 16 (four stride-2 stages)")
        w, x2 = width, 2 * width
        dw = width // 2  # InsightFace's depthwise stem uses 64 groups at width 128
        stem = [ConvBlock(3, w, 3, 2, padding=1)]
        if blocks[0] == 1:
            stem.append(ConvBlock(w, w, 3, 1, groups=dw, padding=1))
        else:
            stem += [Bottleneck(w, w, w, residual=True) for _ in range(blocks[0])]
        stages = [(w, w, w, blocks[1]), (w, x2, x2, blocks[2]), (x2, x2, 4 * w, blocks[3])]
        body = []
        for cin, cout, hidden, n in stages:
            body.append(Bottleneck(cin, cout, hidden, stride=2))
            body += [Bottleneck(cout, cout, x2 if cout == x2 else w, residual=True) for _ in range(n)]
        self.layers = nn.Sequential(*stem, *body)
        self.conv_sep = ConvBlock(x2, GDC_CHANNELS)
        k = image_size // 16
        self.gdc = ConvBlock(GDC_CHANNELS, GDC_CHANNELS, k, groups=GDC_CHANNELS, linear=True)
        self.fc = nn.Linear(GDC_CHANNELS, embedding_size, bias=False)
        self.features = nn.BatchNorm1d(embedding_size)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def forward(self, x):
        # A pipeline stage holds some of the modules (``pipeline``); the others are None and skipped.
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        if self.fc is None:
            return x
        x = self.gdc(self.conv_sep(x))
        return self.features(self.fc(x.flatten(1)))


# The pipeline split (``toolkit.stages``) of a MobileFaceNet at ``backbone`` (a path prefix): the stem and the
# bottlenecks are the repeated layers; the separable conv, GDC and embedding run on the last stage.
def pipeline(backbone: str) -> dict:
    return {"layers": f"{backbone}.layers", "first": [],
            "last": [f"{backbone}.{m}" for m in ("conv_sep", "gdc", "fc", "features")]}
